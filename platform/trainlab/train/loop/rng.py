"""Seeding, deterministic mode, and the RNG state that goes into every checkpoint.

The captured state holds only tensors, ints, lists and dicts, so it loads with
`torch.load(..., weights_only=True)`.
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices) with `seed`."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_deterministic(enabled: bool) -> None:
    """Deterministic algorithms everywhere (train.deterministic).

    CUBLAS_WORKSPACE_CONFIG is required by cuBLAS for deterministic matmuls on GPU;
    on CPU the flag makes torch refuse the few non-deterministic kernels.
    """
    if enabled == torch.are_deterministic_algorithms_enabled():
        return  # setting it imports torch._inductor (seconds): only when it changes
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled)
    if torch.backends.cudnn.is_available():
        torch.backends.cudnn.deterministic = enabled
        torch.backends.cudnn.benchmark = not enabled


def capture_rng() -> dict[str, Any]:
    """The RNG state of Python, NumPy and torch (and CUDA when present) of this process."""
    py_version, py_state, py_gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": {"version": py_version, "state": list(py_state), "gauss": py_gauss},
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Undo `capture_rng`: the process continues with exactly the captured streams."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    npst = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": npst["bit_generator"],
            "state": {"key": npst["key"].numpy().astype(np.uint32), "pos": npst["pos"]},
            "has_gauss": npst["has_gauss"],
            "gauss": npst["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
