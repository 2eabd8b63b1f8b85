"""Dynamic loss scaling for fp16 (Megatron's DynamicGradScaler): halve on inf/nan and skip the
step, double after `window` clean steps."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class LossScaler:
    scale: float = 2.0**16
    window: int = 1000
    min_scale: float = 1.0
    clean_steps: int = 0
    skipped: int = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.min_scale, self.scale / 2)
            self.clean_steps = 0
            self.skipped += 1
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.window:
                self.scale *= 2
                self.clean_steps = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, d: dict) -> None:
        for k, v in d.items():
            setattr(self, k, v)
