"""Capture and restore every RNG the trainer draws from, as plain JSON for the checkpoint manifest.

Python's `random`, numpy's global RNG, torch's CPU generator and, when CUDA is available, every
visible device's generator. torch states are byte tensors, kept as base64 strings; no pickle.
"""

from __future__ import annotations

import base64
import random

import numpy as np
import torch


def _b64(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state_to_json() -> dict:
    version, state, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    out = {
        "python": {"version": version, "state": list(state), "gauss_next": gauss_next},
        "numpy": {
            "name": name,
            "keys": keys.tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def rng_state_from_json(state: dict) -> None:
    """Restore what `rng_state_to_json` captured; CUDA states only where those devices exist."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    n = state["numpy"]
    keys = np.array(n["keys"], dtype=np.uint32)
    np.random.set_state((n["name"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(_bytes_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(_bytes_tensor(s), i)


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's global RNGs as a fresh `mlm train` run does."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def seeded_rng_state(seed: int) -> dict:
    """The RNG state of a fresh `mlm train` run seeded with `seed`, as `rng_state_to_json` gives it
    (this process's own state is left as it was)."""
    before = rng_state_to_json()
    seed_everything(seed)
    state = rng_state_to_json()
    rng_state_from_json(before)
    return state
