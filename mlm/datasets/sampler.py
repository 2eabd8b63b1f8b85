"""The trainer's position in a dataset: consumed samples, split over data-parallel ranks.

As Megatron's MegatronPretrainingSampler: the global order is 0, 1, 2, ... (the datasets are
already shuffled); each step of micro_batch × dp consecutive samples gives rank r the slice
[r·micro, (r+1)·micro). Resuming needs only `consumed_samples`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from mlm.errors import MlmError


@dataclass
class PretrainingSampler:
    total_samples: int
    consumed_samples: int
    micro_batch_size: int
    dp_rank: int = 0
    dp_size: int = 1

    def __post_init__(self):
        if self.micro_batch_size < 1 or self.dp_size < 1 or not 0 <= self.dp_rank < self.dp_size:
            raise MlmError(
                f"micro_batch_size={self.micro_batch_size}, dp_rank={self.dp_rank}, dp_size={self.dp_size}: "
                "need micro_batch_size >= 1 and 0 <= dp_rank < dp_size"
            )
        if not 0 <= self.consumed_samples <= self.total_samples:
            raise MlmError(
                f"consumed_samples={self.consumed_samples}: must be within [0, {self.total_samples}]"
            )

    def __iter__(self) -> Iterator[np.ndarray]:
        """This rank's micro batches from `consumed_samples` on (a last partial step is dropped).

        `consumed_samples` counts a step as soon as it is handed out, so a checkpoint taken
        after training on it resumes at the next one."""
        step = self.micro_batch_size * self.dp_size
        while self.consumed_samples + step <= self.total_samples:
            begin = self.consumed_samples + self.dp_rank * self.micro_batch_size
            self.consumed_samples += step
            yield np.arange(begin, begin + self.micro_batch_size, dtype=np.int64)

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}
