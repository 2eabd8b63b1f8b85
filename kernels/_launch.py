"""What the kernels' launchers share: block sizes and a rows-per-program split."""

from __future__ import annotations

import torch
import triton


def row_blocks(n_cols: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_M): the columns as one power-of-two block, and as many rows per block as
    keep a block near 4096 elements (1 row for rows of 4096 or more)."""
    block_n = triton.next_power_of_2(n_cols)
    return block_n, max(1, min(16, 4096 // block_n))


def program_count(n_row_blocks: int, device: torch.device) -> int:
    """Programs for a backward that accumulates weight gradients per program: one per SM on CUDA
    (each walks several row blocks), a few under the interpreter (each program is Python)."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(n_row_blocks, sms))
    return max(1, min(n_row_blocks, 4))


class Rows:
    """A row-wise kernel's view of x [..., N]: contiguous rows `x` [M, N], the block sizes, and
    the grids of the forward (one program per row block) and of a backward that accumulates
    weight gradients per program (`backward_split`); what the norms' Triton Functions share."""

    def __init__(self, x: torch.Tensor):
        self.shape, self.N = x.shape, x.shape[-1]
        self.x = x.reshape(-1, self.N).contiguous()
        self.M = self.x.shape[0]
        self.BLOCK_N, self.BLOCK_M = row_blocks(self.N)
        self.blocks = triton.cdiv(self.M, self.BLOCK_M)

    def stats(self) -> torch.Tensor:
        """An fp32 buffer of one statistic per row [M]."""
        return torch.empty(self.M, dtype=torch.float32, device=self.x.device)

    def backward_split(self, partials: int) -> tuple[int, int, list[torch.Tensor]]:
        """(programs, row blocks per program, `partials` fp32 [programs, N] buffers for the
        programs' partial weight gradients, summed on the host)."""
        programs = program_count(self.blocks, self.x.device)
        buffers = [
            torch.empty((programs, self.N), dtype=torch.float32, device=self.x.device)
            for _ in range(partials)
        ]
        return programs, triton.cdiv(self.blocks, programs), buffers
