"""What a training process holds between steps, as a few stateful parts.

Each part has `state_dict()` / `load_state_dict()`; a checkpoint is these parts
composed by `trainlab.train.checkpointer.Checkpointer`, which alone knows the
file formats. Parts:

- `ModelState`: the (wrapped) model, its optimizer and the fp16 grad scaler;
  full state dicts on rank 0 (single process, DDP, ZeRO-1) or sharded ones on
  every rank (FSDP), as `sharded` says.
- `Progress`: optimizer steps done and the latest evaluation.
- `DataPosition`: where the data stream continues (the loader's own state).
- `RNG`: this rank's Python, NumPy and torch generators.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from trainlab.config.schema import ExperimentConfig, ModelConfig
from trainlab.models import build_model
from trainlab.train.distributed import DistEnv
from trainlab.train.parallel import apply_parallelism, build_optimizer, unwrap, uses_zero1
from trainlab.train.rng import capture_rng, restore_rng, seed_everything, set_deterministic


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class Progress:
    step: int = 0  # optimizer steps done
    val_losses: dict[str, float] = field(default_factory=dict)  # the latest evaluation

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "val_losses": dict(self.val_losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.val_losses = dict(state.get("val_losses") or {})


class DataPosition:
    """The data stream's position: the next step to train (`progress.step`)."""

    def __init__(self, loader: Any, progress: Progress):
        self.loader, self.progress = loader, progress

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict(self.progress.step)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)  # the data's own rules (dataset fingerprint)


class RNG:
    def state_dict(self) -> dict[str, Any]:
        return capture_rng()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore_rng(state)


class ModelState:
    """Model, optimizer and grad scaler of one rank, built for the run's layout."""

    def __init__(self, cfg: ExperimentConfig, env: DistEnv):
        self.cfg, self.env = cfg, env
        set_deterministic(cfg.train.deterministic)
        seed_everything(cfg.train.seed)  # the same initial weights on every rank
        self.model = apply_parallelism(build_model(cfg.model).to(env.device), cfg, env)
        self.optimizer = build_optimizer(self.model, cfg, env)
        self.scaler = torch.amp.GradScaler("cuda") if cfg.train.precision == "fp16" else None
        self.sharded = cfg.parallel.strategy == "fsdp" and env.distributed
        seed_everything(cfg.train.seed + 1 + env.rank)  # dropout differs per rank, reproducibly

    def state_dict(self) -> dict[str, Any]:
        """{"model", "optimizer"}: sharded on every rank, or full on rank 0 (empty
        elsewhere). A collective under FSDP and ZeRO-1: call it on every rank."""
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import (
                get_model_state_dict,
                get_optimizer_state_dict,
            )

            return {
                "model": get_model_state_dict(self.model),
                "optimizer": get_optimizer_state_dict(self.model, self.optimizer),
            }
        if uses_zero1(self.cfg, self.env):
            self.optimizer.consolidate_state_dict(to=0)
        if not self.env.is_main:
            return {}
        return {"model": unwrap(self.model).state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import (
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            set_model_state_dict(self.model, state["model"])
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
            return
        unwrap(self.model).load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The whole model's weights on rank 0 (a collective under FSDP)."""
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            return get_model_state_dict(
                self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        return unwrap(self.model).state_dict() if self.env.is_main else {}


@dataclass
class TrainState:
    """Everything a checkpoint restores, by part."""

    model: ModelState
    progress: Progress
    data: DataPosition
    rng: RNG = field(default_factory=RNG)


def state_dict_sha256(state: dict[str, torch.Tensor]) -> str:
    """Hash of a state dict in canonical order: sorted keys, each with its dtype,
    shape and raw bytes. Equal weights give equal hashes, bit for bit."""
    h = hashlib.sha256()
    for key in sorted(state):
        t = state[key].detach().cpu().contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def cloned(obj: Any) -> Any:
    """A deep copy of the tensors in a nested state dict (for writing it in the
    background while training changes the live tensors)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: cloned(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(cloned(v) for v in obj)
    return obj


def fresh_cpu_model(m: ModelConfig) -> nn.Module:
    """An uninitialized CPU model of `m`, built on the meta device and materialized
    empty, so building it draws nothing from the random generators."""
    with torch.device("meta"):
        model = build_model(m)
    return model.to_empty(device="cpu")
