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
from trainlab.train.parallel import apply_layout, build_optimizer, unwrap, uses_zero1
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


FLAT = {"flatten_optimizer_state_dict": True}
_COPY, _TABLE = ".output.weight.", ".tok_embeddings.weight."


def _renamed(optim: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    return {k.replace(old, new, 1): v for k, v in optim.items()}


class ModelState:
    """Model, optimizer and grad scaler of one rank, built for the run's layout.

    `parts` is the model as this rank holds it (one module, or its pipeline
    stages, trainlab.train.parallel.ParallelModel), with one optimizer each.
    `format` is how checkpoints hold it: "torch" (full state dicts on rank 0:
    one process, DDP, ZeRO-1) or "dcp" (every rank its shards, by the whole
    model's parameter names, so any layout loads any other's)."""

    def __init__(self, cfg: ExperimentConfig, env: DistEnv):
        self.cfg, self.env = cfg, env
        set_deterministic(cfg.train.deterministic)
        seed_everything(cfg.train.seed)  # the same initial weights on every rank
        self.parallel = apply_layout(build_model(cfg.model).to(env.device), cfg, env)
        self.parts = self.parallel.parts
        self.pipeline = self.parallel.pipeline
        self.model = self.parts[0]
        self.optimizers = [build_optimizer(part, cfg, env) for part in self.parts]
        self.optimizer = self.optimizers[0]
        self.scaler = torch.amp.GradScaler("cuda") if cfg.train.precision == "fp16" else None
        fsdp = cfg.parallel.strategy == "fsdp" and env.distributed
        self.sharded = fsdp or self.parallel.sharded
        self.format = "dcp" if self.sharded else "torch"
        # Dropout differs per model replica, reproducibly; the ranks of one
        # tensor-parallel group share their stream (their activations are replicas).
        tp_rank = env.coords.tp
        seed_everything(cfg.train.seed + 1 + env.rank - tp_rank)

    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters()]

    def tied_copies(self) -> frozenset[int]:
        """ids of parameters that are a second copy of a tied table (pipeline)."""
        from trainlab.train.pipeline import is_tied_copy

        return frozenset(id(part.output.weight) for part in self.parts if is_tied_copy(part))

    # ---------------------------------------------------------------- state dicts

    def _dcp_parts(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """(model, flattened optimizer) state dicts of each part, by the whole
        model's names (a tied table's pipeline copy under the table's name)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        from trainlab.train.pipeline import is_tied_copy

        out = []
        for part, opt in zip(self.parts, self.optimizers, strict=True):
            optim = get_optimizer_state_dict(part, opt, options=StateDictOptions(**FLAT))
            if is_tied_copy(part):
                optim = _renamed(optim, _COPY, _TABLE)
            out.append((get_model_state_dict(part), optim))
        return out

    def state_dict(self) -> dict[str, Any]:
        """{"model", "optimizer"}: sharded on every rank ("dcp"), or full on rank 0
        (empty elsewhere). A collective when sharded and under ZeRO-1: call it on
        every rank."""
        if self.sharded:
            model: dict[str, Any] = {}
            optim: dict[str, Any] = {}
            for m, o in self._dcp_parts():
                model.update(m)
                optim.update(o)
            return {"model": model, "optimizer": optim}
        if uses_zero1(self.cfg, self.env):
            self.optimizer.consolidate_state_dict(to=0)
        if not self.env.is_main:
            return {}
        return {"model": unwrap(self.model).state_dict(), "optimizer": self.optimizer.state_dict()}

    def dcp_state_dict(self) -> dict[str, Any]:
        """The "dcp" form of the state whatever this layout saves, to load a "dcp"
        checkpoint into (every rank; not under ZeRO-1)."""
        if self.sharded:
            return self.state_dict()
        if uses_zero1(self.cfg, self.env):
            raise RuntimeError(
                "resuming a sharded (dcp) checkpoint with ZeRO-1 is not supported: "
                "resume with parallel.zero_stage 0, 2 or 3"
            )
        model: dict[str, Any] = {}
        optim: dict[str, Any] = {}
        for m, o in self._dcp_parts():
            model.update(m)
            optim.update(o)
        return {"model": model, "optimizer": optim}

    def load_dcp_state_dict(self, state: dict[str, Any]) -> None:
        """Load a state dict filled from a "dcp" checkpoint (see dcp_state_dict)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from trainlab.train.pipeline import is_tied_copy

        options = StateDictOptions(**FLAT)
        layouts = self._dcp_parts()
        for part, opt, (m, o) in zip(self.parts, self.optimizers, layouts, strict=True):
            model = {k: state["model"][k] for k in m}
            optim = {k: state["optimizer"][k] for k in o}
            if is_tied_copy(part):
                optim = _renamed(optim, _TABLE, _COPY)
            set_model_state_dict(part, model)
            set_optimizer_state_dict(part, opt, optim, options=options)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.sharded:
            self.load_dcp_state_dict(state)
            return
        unwrap(self.model).load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def weights_digest(self) -> str | None:
        """`state_dict_sha256` of the whole model's weights on rank 0, computed a
        tensor at a time (each gathered from its shards, hashed and dropped): no
        rank ever holds the whole model. A collective: call it on every rank."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        dp_rank, tp_rank = self.env.coords.dp, self.env.coords.tp
        # One rank per pipeline stage contributes (rank 0 alone without pipelines).
        contributes = dp_rank == tp_rank == 0 if self.parallel.sharded else self.env.is_main
        digests: dict[str, str] = {}
        for part in self.parts:
            for key, value in get_model_state_dict(part).items():
                full = value.full_tensor() if hasattr(value, "full_tensor") else value
                if contributes:
                    digests[key] = tensor_digest(full)
        if self.env.distributed and self.parallel.sharded:
            gathered: list[Any] = [None] * self.env.world_size
            dist.all_gather_object(gathered, digests)
            for other in gathered:
                digests.update(other or {})
        if not self.env.is_main:
            return None
        return combine_digests(digests)


@dataclass
class TrainState:
    """Everything a checkpoint restores, by part."""

    model: ModelState
    progress: Progress
    data: DataPosition
    rng: RNG = field(default_factory=RNG)


def fill_from_full(target: dict[str, Any], full: dict[str, Any]) -> None:
    """Copy whole tensors `full[k]` into `target[k]`, which may be shards
    (DTensors: each rank keeps its part of the whole, which every rank holds);
    other values are replaced."""
    from torch.distributed.tensor import DTensor, Replicate

    for key, t in target.items():
        src = full[key]
        if isinstance(t, DTensor):
            mesh = t.device_mesh
            whole = DTensor.from_local(
                src.to(t.device, t.dtype), mesh, [Replicate()] * mesh.ndim, run_check=False
            )
            t.to_local().copy_(whole.redistribute(mesh, t.placements).to_local())
        elif isinstance(t, torch.Tensor):
            t.copy_(src)
        else:
            target[key] = src


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of one tensor's dtype, shape and raw bytes."""
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def combine_digests(digests: dict[str, str]) -> str:
    h = hashlib.sha256()
    for key in sorted(digests):
        h.update(f"{key}|{digests[key]}|".encode())
    return h.hexdigest()


def state_dict_sha256(state: dict[str, torch.Tensor]) -> str:
    """Hash of a state dict in canonical order: sorted keys, each with the hash of
    its dtype, shape and raw bytes. Equal weights give equal hashes, bit for bit,
    whatever layout held them (see ModelState.weights_digest)."""
    return combine_digests({key: tensor_digest(t) for key, t in state.items()})


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
    model = model.to_empty(device="cpu")
    if m.tie_embeddings:  # to_empty gives each module its own tensor: tie them again
        model.output.weight = model.tok_embeddings.weight
    return model
