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
