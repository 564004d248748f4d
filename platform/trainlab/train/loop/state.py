"""What a training process holds between steps, as a few stateful parts.

Each part has `state_dict()` / `load_state_dict()`; a checkpoint is these parts
composed by `trainlab.train.loop.checkpointer.Checkpointer`, which alone knows the
file formats. Parts:

- `ModelState`: the (wrapped) model, its optimizer and the fp16 grad scaler; its
  state dict is torch.distributed.checkpoint's form for every layout: each
  rank's entries by the whole model's parameter names (sharded tensors as
  DTensors), so any layout loads any other's.
- `Progress`: optimizer steps done and the latest evaluation.
- `DataPosition`: where the data stream continues (the loader's own state).
- `RNG`: this rank's Python, NumPy and torch generators.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trainlab.config.schema import ExperimentConfig, ModelConfig
from trainlab.models import arch_of, build_model
from trainlab.models.moe.layer import moe_layers
from trainlab.train.loop.rng import capture_rng, restore_rng, seed_everything, set_deterministic
from trainlab.train.parallel import build_optimizer, parallelize, uses_zero1
from trainlab.train.parallel.distributed import DistEnv


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
# Optimizer settings that choose a kernel, kept as built when a checkpoint loads.
KERNEL_FLAGS = ("fused", "foreach")
_COPY, _TABLE = ".output.weight.", ".tok_embeddings.weight."


def _renamed(optim: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    return {k.replace(old, new, 1): v for k, v in optim.items()}


class PartOptimizers:
    """One optimizer per part of the model as this rank holds it (one part, or
    its pipeline stages), stepped together."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self._all = list(optimizers)

    def __iter__(self) -> Any:
        return iter(self._all)

    def __len__(self) -> int:
        return len(self._all)

    def only(self) -> torch.optim.Optimizer:
        """The optimizer of a model in one part (fp16's GradScaler, tests); a
        pipeline's stages have one each (fp16 with pp is refused by the config)."""
        if len(self._all) != 1:
            raise ValueError(f"{len(self._all)} optimizers (one per pipeline stage), not one")
        return self._all[0]

    def set_lr(self, lr: float) -> None:
        for optimizer in self._all:
            for group in optimizer.param_groups:
                group["lr"] = lr

    def step(self) -> None:
        for optimizer in self._all:
            optimizer.step()

    def zero_grad(self) -> None:
        for optimizer in self._all:
            optimizer.zero_grad(set_to_none=True)


class ModelState:
    """Model, optimizer and grad scaler of one rank, built for the run's layout.

    `parts` is the model as this rank holds it (one module, or its pipeline
    stages, trainlab.train.parallel.ParallelModel), with one optimizer each.
    Checkpoints hold it in one format, torch.distributed.checkpoint (DCP): every
    rank's entries by the whole model's parameter names, the optimizer state
    flattened by them, so any layout and world size loads any other's.
    `sharded`: whether the parameters are split over ranks (FSDP, tp, pp)."""

    def __init__(self, cfg: ExperimentConfig, env: DistEnv):
        self.cfg, self.env = cfg, env
        set_deterministic(cfg.train.deterministic)
        seed_everything(cfg.train.seed)  # the same initial weights on every rank
        self.parallel = parallelize(build_model(cfg.model).to(env.device), cfg, env)
        self.parts = self.parallel.parts
        self.pipeline = self.parallel.pipeline
        self.model = self.parts[0]
        self.optimizers = PartOptimizers([build_optimizer(part, cfg, env) for part in self.parts])
        self.scaler = torch.amp.GradScaler("cuda") if cfg.train.precision == "fp16" else None
        # The MoE layers (model.moe) whose router statistics and balance the step
        # finishes (trainlab.models.moe.layer), and the last step's statistics.
        self.moe_layers = [layer for part in self.parts for layer in moe_layers(part)]
        self.moe_stats: torch.Tensor | None = None
        fsdp = cfg.parallel.strategy == "fsdp" and env.distributed
        self.sharded = fsdp or self.parallel.sharded
        # Dropout differs per model replica, reproducibly; the ranks of one
        # tensor-parallel group share their stream (their activations are replicas).
        tp_rank = env.coords.tp
        seed_everything(cfg.train.seed + 1 + env.rank - tp_rank)

    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters()]

    def tied_copies(self) -> frozenset[int]:
        """ids of parameters that are a second copy of a tied table (pipeline)."""
        from trainlab.train.parallel.pipeline import is_tied_copy

        if self.parallel.pipeline is None:
            return frozenset()
        return frozenset(id(part.output.weight) for part in self.parts if is_tied_copy(part))

    # ---------------------------------------------------------------- state dicts

    def _stepped_optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizer whose state each part's checkpoint entries hold: under
        ZeRO-1, the rank's local optimizer over its partition (each rank writes and
        reads the entries of its own parameters), else the optimizer itself."""
        if uses_zero1(self.cfg, self.env):
            return [opt.optim for opt in self.optimizers]
        return list(self.optimizers)

    def _parts_state(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """(model, flattened optimizer) state dicts of each part, by the whole
        model's names (a tied table's pipeline copy under the table's name)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        from trainlab.train.parallel.pipeline import is_tied_copy

        out = []
        for part, opt in zip(self.parts, self._stepped_optimizers(), strict=True):
            optim = get_optimizer_state_dict(part, opt, options=StateDictOptions(**FLAT))
            if self.pipeline is not None and is_tied_copy(part):
                optim = _renamed(optim, _COPY, _TABLE)
            out.append((get_model_state_dict(part), optim))
        return out

    def state_dict(self) -> dict[str, Any]:
        """{"model", "optimizer"} in DCP's form: this rank's entries (shards as
        DTensors; replicated tensors, which DCP writes once). Every rank calls it."""
        model: dict[str, Any] = {}
        optim: dict[str, Any] = {}
        for m, o in self._parts_state():
            model.update(m)
            optim.update(o)
        return {"model": model, "optimizer": optim}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a state dict of `state_dict()`'s form, filled from a checkpoint."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from trainlab.train.parallel.pipeline import is_tied_copy

        options = StateDictOptions(**FLAT)
        layouts = self._parts_state()
        optimizers = self._stepped_optimizers()
        for part, opt, (m, o) in zip(self.parts, optimizers, layouts, strict=True):
            model = {k: state["model"][k] for k in m}
            optim = {k: state["optimizer"][k] for k in o}
            if self.pipeline is not None and is_tied_copy(part):
                optim = _renamed(optim, _TABLE, _COPY)
            set_model_state_dict(part, model)
            # How this process's optimizer runs (fused or not: trainlab.optim.adamw
            # decides by its parameters) is not the checkpoint's to change: a layout
            # whose parameters mix tensors and DTensors cannot run the fused kernel
            # another layout saved it with.
            kernels = [{k: g[k] for k in KERNEL_FLAGS if k in g} for g in opt.param_groups]
            if uses_zero1(self.cfg, self.env):
                load_flat_optimizer_state(part, opt, state["optimizer"])
            else:
                set_optimizer_state_dict(part, opt, optim, options=options)
            for group, flags in zip(opt.param_groups, kernels, strict=True):
                group.update(flags)

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


def load_flat_optimizer_state(model: nn.Module, optimizer: Any, flat: dict[str, Any]) -> None:
    """Load `optimizer` (ZeRO-1's local optimizer over this rank's partition) from
    the flattened state by parameter name ("state.{fqn}.{key}",
    "param_groups.{fqn}.{key}"), by hand: torch's unflattening refuses a param
    group left empty by the partition."""
    inner = getattr(model, "module", model)
    names = {id(p): name for name, p in inner.named_parameters()}
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for group in optimizer.param_groups:
        ids = []
        settings = {k: v for k, v in group.items() if k != "params"}
        for p in group["params"]:
            fqn = names[id(p)]
            prefix = f"state.{fqn}."
            entry = {k[len(prefix) :]: v for k, v in flat.items() if k.startswith(prefix)}
            if entry:
                state[index] = entry
            for key in settings:
                saved = flat.get(f"param_groups.{fqn}.{key}")
                if saved is not None:
                    settings[key] = saved
            ids.append(index)
            index += 1
        groups.append({**settings, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


@dataclass
class TrainState:
    """Everything a checkpoint restores, by part."""

    model: ModelState
    progress: Progress
    data: DataPosition
    rng: RNG = field(default_factory=RNG)


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
    empty, so building it draws nothing from the random generators. An
    architecture brought by the user is built on the CPU under a forked random
    state instead: its buffers outside the state dict (e.g. RoPE's frequencies)
    are only right as its constructor computes them."""
    if arch_of(m).measured:
        with torch.random.fork_rng(devices=[]):
            return build_model(m)
    with torch.device("meta"):
        model = build_model(m)
    model = model.to_empty(device="cpu")
    if m.tie_embeddings:  # to_empty gives each module its own tensor: tie them again
        model.output.weight = model.tok_embeddings.weight
    return model
