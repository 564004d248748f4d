"""Memory of one real training step, traced at full size without allocating it.

`trace_memory(cfg, layout)` builds the model trainlab builds (`build_model`),
wraps it with the trainer's own code (`trainlab.train.parallel`:
`apply_parallelism`, `build_optimizer`, `gradient_sync`; `trainlab.train.loop.step`:
`autocast_context`, `loss_sum_and_count`) and runs one optimizer step the way
`train_step` does (per micro batch: forward and loss under the sync context
and autocast, backward; then gradient clipping, the optimizer step,
`zero_grad(set_to_none=True)`), as rank 0 of a world of the layout's size, on a
packed batch as the loader makes it (position and document ids: attention gets
the block-diagonal mask). `train_step` itself is not called: it reads the
number of labelled tokens and the loss as Python numbers, which fake tensors do
not have. With:

- fake tensors (`torch._subclasses.fake_tensor.FakeTensorMode`): shapes,
  dtypes and devices, no storage, so a 70B model "fits" on a laptop;
- a fake process group (`dist.init_process_group("fake")`) of the layout's
  world size: collectives return at once, with the right shapes;
- torch's memory trackers (`torch.distributed._tools`): `FSDPMemTracker` for
  FSDP, `MemTracker` otherwise. They see every tensor storage the step
  creates and frees, by category, and keep the peak (here trimmed to the whole
  step's peak, with logits-shaped tensors counted apart).

What is measured is the steady state, step 2 onwards: the optimizer state
exists before the traced step (created as AdamW's first step creates it, not
measured), gradients do not (`zero_grad(set_to_none=True)` freed them); with
gradient accumulation two micro batches run, the second starting with the
first's gradients.

The "device" is the CPU (a CPU build of torch cannot fake CUDA tensors: the
autograd engine asks for a CUDA device guard). What differs from a GPU run,
and what is done about it:

- AdamW: on CUDA torch picks the `foreach` implementation (one temporary as
  large as a parameter group), on CPU the per-tensor loop; the trace sets
  `foreach` to what the target device would use (`resource.use_gpu`).
- Autocast: CPU and CUDA autocast cast the ops of these models alike (matmuls,
  linear, SDPA to 16 bits; the norms, RoPE, softmax and the loss are fp32 in
  the model code) except layer_norm, which CUDA runs in fp32: for a GPU target
  the trace runs it so (`_cuda_autocast_norms`).
- SDPA: CPU and CUDA kernels keep the same tensors for backward (q, k, v, the
  output, the log-sum-exp, the converted mask) without dropout.
- Attention: `model.attention` is resolved for the target device (`auto`:
  FlexAttention on CUDA); FlexAttention, which has no CPU backward, is stood
  in for by SDPA with `is_causal` (the same saved tensors, no mask:
  `_target_attention`).
- The loss: the chunked cross-entropy's fp32 chunks (`train.loss_chunk_tokens`)
  count as `logits_loss` with the logits. With
  `model.dropout > 0` CPU falls back to the math kernel (attention weights and
  masks kept), CUDA's flash kernel does not: the trace overstates such runs.
- The CUDA caching allocator rounds each block to 512 bytes; irrelevant at
  these sizes. Allocator fragmentation, the CUDA context and NCCL's own
  buffers are not tensors and not traced (`framework` in the estimate; the
  traced figure carries the same constant so totals compare like for like).
- DDP: the fake process group's futures carry no value, so the trace installs
  a comm hook that returns the bucket itself (what the default all-reduce hook
  does in place, same memory), and skips DDP's cross-rank parameter-shape check,
  which reads tensor data.
- FSDP: `fully_shard` is handed the device mesh built before fake mode
  (building it inside fails); DTensor's shape propagation, which runs on
  global-size fake tensors of the active fake mode, is given a fake mode of its
  own so the tracker does not count it.
- fp16: the grad scaler is CUDA-only; the trace runs fp16 autocast without it
  (the scaler holds two scalars).

`tp`/`pp` > 1 are refused: the trainer does not execute them yet.

The trace leaves no global state behind: the fake process group is destroyed,
the patched functions restored, the trackers' global optimizer hooks removed;
building fake tensors draws nothing from the random generators. (torch keeps
its own caches, e.g. DTensor's sharding propagation, which make a second trace
of the same shapes faster.)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from trainlab.config.schema import ExperimentConfig
from trainlab.errors import UserError
from trainlab.plan.memory import CATEGORIES, framework_bytes, layout_config

__all__ = ["TraceResult", "trace_memory", "trace_step"]


@dataclass
class TraceResult:
    """The traced peak of one rank, in the estimate's categories (bytes), and how
    the trace went."""

    memory: dict[str, float]  # CATEGORIES + "total"
    phase: str  # forward | backward | clip | optimizer: where the peak was
    phase_peaks: dict[str, int]  # the highest tensor total of each phase
    phase_seconds: dict[str, float]  # time the trace spent in each phase
    phase_snaps: dict[str, dict[str, int]]  # the tracker's categories at each phase's peak
    world_size: int
    seconds: float  # wall time of building and tracing
    raw: dict[str, int] = field(default_factory=dict)  # the tracker's own categories
    notes: list[str] = field(default_factory=list)


def trace_memory(
    cfg: ExperimentConfig, layout: Any = None, micro_batch: int | None = None
) -> dict[str, float]:
    """The traced peak memory of rank 0 by category (the names of
    `trainlab.plan.memory.memory_breakdown`) plus `total`, in bytes.

    `layout` (tp, pp, dp, zero_stage) defaults to what the planner chooses for
    `cfg`; `micro_batch` to `data.micro_batch_size`."""
    return trace_step(cfg, layout, micro_batch).memory


def trace_step(
    cfg: ExperimentConfig, layout: Any = None, micro_batch: int | None = None
) -> TraceResult:
    """`trace_memory` with where the peak was, the tracker's raw categories and the
    time taken."""
    from trainlab.plan.planner import Layout, plan, resolve_layout

    d, par = cfg.data, cfg.parallel
    concrete = (
        isinstance(d.micro_batch_size, int)
        and d.grad_accum_steps is not None
        and par.activation_checkpointing != "auto"
    )
    if layout is None or not concrete:
        p = plan(cfg)
        cfg = resolve_layout(cfg, p)  # micro batch, accumulation, recomputation made concrete
        layout = layout or Layout(**p.parallel)
    if layout.tp > 1 or layout.pp > 1:
        raise UserError(
            f"trace: tp={layout.tp} pp={layout.pp}: the trainer does not execute tensor or "
            "pipeline parallelism yet, so there is nothing to trace"
        )
    run_cfg = layout_config(cfg, layout)
    mb = int(micro_batch or cfg.data.micro_batch_size)
    t0 = time.perf_counter()
    with _fake_world(layout.dp) as env:
        result = _trace(run_cfg, env, mb)
    result.seconds = time.perf_counter() - t0
    return result


# --------------------------------------------------------------------------- the fake world


@contextlib.contextmanager
def _fake_world(world_size: int) -> Iterator[Any]:
    """A fake process group of `world_size` with this process as rank 0 (none for a
    single device), and the rank's DistEnv; torn down on exit."""
    import torch
    import torch.distributed as dist

    from trainlab.train.parallel.distributed import DistEnv

    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "trace: a torch.distributed process group is already initialized in this "
            "process; trace in a process of its own"
        )
    env = DistEnv(rank=0, world_size=world_size, local_rank=0, device=torch.device("cpu"))
    if world_size == 1:
        yield env
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield env
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, original)


@contextlib.contextmanager
def _trainer_under_fakes(fsdp: bool, world_size: int) -> Iterator[None]:
    """What the trainer's parallel code needs to run on fakes (see the module
    docstring): FSDP's default mesh built outside fake mode, DDP's shape check
    (it reads tensor data) skipped, DTensor's shape propagation kept out of the
    count."""
    import torch.distributed.fsdp._fully_shard._fully_shard as fully_shard_mod
    import torch.distributed.tensor._sharding_prop as sharding_prop_mod
    import torch.nn.parallel.distributed as ddp_mod

    with contextlib.ExitStack() as stack:
        # DTensor derives output shapes on global-size fake tensors of a fake mode
        # of its own, which the trackers skip; it reuses the active fake mode when
        # there is one (ours), and they would count those as activations.
        stack.enter_context(_patched(sharding_prop_mod, "detect_fake_mode", lambda *a: None))
        if fsdp:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (world_size,))
            stack.enter_context(
                _patched(fully_shard_mod, "_init_default_mesh", lambda *a, **k: mesh)
            )
        stack.enter_context(
            _patched(ddp_mod, "_verify_param_shape_across_processes", lambda *a, **k: None)
        )
        yield


# --------------------------------------------------------------------------- the trace


def _trackers() -> tuple[type, type]:
    """MemTracker and FSDPMemTracker, trimmed to what the trace reads (the peak of
    the whole step, not every module's) and with logits tensors counted apart."""
    import torch
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

    device_op = torch.ops.prim.device.default

    class _Lean:
        peak_phase = "setup"
        logits_shape: tuple[int, int] = (0, 0)  # (tokens, vocab)
        logits_rows: set[int] = set()  # rows of the loss's [rows, vocab] tensors
        logits_now = 0
        logits_at_peak = 0
        phase_peaks: dict[str, int] | None = None
        phase_seconds: dict[str, float] | None = None
        phase_snaps: dict[str, dict[str, int]] | None = None
        _phase = "setup"
        _since = 0.0

        @property
        def phase(self) -> str:
            return self._phase

        @phase.setter
        def phase(self, value: str) -> None:
            now = time.perf_counter()
            if self.phase_seconds is not None:
                self.phase_seconds[self._phase] = now - self._since
            self._phase, self._since = value, now

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            if func is device_op:  # `.device` of a tensor: allocates nothing, is frequent
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _update_peak_stats(self, peak_state: Any) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self.phase_peaks is not None and snap[_TOTAL_KEY] > self.phase_peaks.get(
                    self.phase, -1
                ):
                    self.phase_peaks[self.phase] = snap[_TOTAL_KEY]
                    self.phase_snaps[self.phase] = {
                        getattr(k, "value", k): v for k, v in snap.items()
                    } | {"logits": self.logits_now}
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)
                    self.peak_phase = self.phase
                    self.logits_at_peak = self.logits_now

        def _track(self, reftype: Any, t: torch.Tensor) -> None:
            _, vocab = self.logits_shape
            rows = t.numel() // vocab if vocab else 0
            if not (t.dim() >= 2 and t.shape[-1] == vocab and rows in self.logits_rows):
                return super()._track(reftype, t)
            # Logits-shaped when first seen (a view of a weight can have the shape).
            new = [st for st in get_untyped_storages(t) if st not in self._WINFO]
            super()._track(reftype, t)
            for st in new:
                winfo, _ = self._WINFO.get(st, (None, None))
                if winfo is not None:
                    winfo.logits = True
                    self.logits_now += winfo.mem_consumed

        def _delete_callback(self, winfo: Any, w_st: Any) -> None:
            if getattr(winfo, "logits", False):
                self.logits_now -= winfo.mem_consumed
            super()._delete_callback(winfo, w_st)

    class Lean(_Lean, MemTracker):
        pass

    class LeanFSDP(_Lean, FSDPMemTracker):
        pass

    return Lean, LeanFSDP


def _trace(cfg: ExperimentConfig, env: Any, micro_batch: int) -> TraceResult:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainlab.models import arch_of, build_model
    from trainlab.train.loop.step import autocast_context, loss_sum_and_count
    from trainlab.train.parallel import (
        apply_parallelism,
        build_optimizer,
        gradient_sync,
    )

    Lean, LeanFSDP = _trackers()
    fsdp = cfg.parallel.strategy == "fsdp" and env.distributed
    notes: list[str] = []
    seq, vocab = cfg.data.seq_len, cfg.model.vocab_size
    measuring = arch_of(cfg.model).measuring()
    with _trainer_under_fakes(fsdp, env.world_size), FakeTensorMode(), measuring:
        if fsdp:
            model = apply_parallelism(build_model(cfg.model), cfg, env)
            optimizer = build_optimizer(model, cfg, env)
            tracker = LeanFSDP(model, optimizer)
            comm_at_build = 0
        else:
            # Built under the tracker: DDP allocates its gradient buckets here.
            tracker = Lean()
            with tracker:
                model = build_model(cfg.model)
                tracker.track_external(model)
                before = _current_total(tracker)
                model = apply_parallelism(model, cfg, env)
                optimizer = build_optimizer(model, cfg, env)
                comm_at_build = _current_total(tracker) - before
            if hasattr(model, "register_comm_hook"):  # DDP on the fake process group
                model.register_comm_hook(None, _bucket_as_result)
        _use_foreach(optimizer, cfg.resource.use_gpu)
        cfg.train.optimizer.create_state(optimizer)  # the state of step 2 onwards
        # Checkpoints (DCP, async or not) stage to host memory: nothing on the device.
        if not fsdp:
            tracker.track_external(optimizer, getattr(optimizer, "optim", None))
        tokens = micro_batch * seq
        chunk = min(cfg.train.loss_chunk_tokens or tokens, tokens)
        tracker.logits_shape = (tokens, vocab)
        # The chunked loss's fp32 chunks are the loss's too (trainlab.models.loss).
        tracker.logits_rows = {tokens, chunk, tokens % chunk} - {0}
        tracker.phase_peaks, tracker.phase_seconds, tracker.phase_snaps = {}, {}, {}
        tracker.phase = "setup"
        # A packed batch as the loader makes it (trainlab.data.pack): with
        # position and document ids, so attention gets its block-diagonal mask.
        batch = {
            "input_ids": torch.zeros((micro_batch, seq), dtype=torch.long),
            "labels": torch.zeros((micro_batch, seq), dtype=torch.long),
            "position_ids": torch.zeros((micro_batch, seq), dtype=torch.long),
            "document_ids": torch.zeros((micro_batch, seq), dtype=torch.int32),
        }
        precision = cfg.train.precision
        if precision == "fp16":
            notes.append("fp16: traced without the grad scaler (two scalars)")
        if cfg.model.dropout > 0:
            notes.append(
                "model.dropout > 0: CPU attention falls back to the math kernel (attention "
                "weights and masks kept), CUDA's flash kernel keeps none: this trace "
                "overstates a GPU run"
            )
        norms = (torch.nn.LayerNorm, torch.nn.GroupNorm)
        emulate = (
            cfg.resource.use_gpu
            and precision != "fp32"
            and any(isinstance(m, norms) for m in model.modules())
        )
        gpu_policy = _cuda_autocast_norms() if emulate else contextlib.nullcontext()
        attention = _target_attention(cfg.resource.use_gpu)
        # Gradient accumulation: from the second micro batch on, the step starts with
        # the gradients of the earlier ones; two show the steady state.
        micro_batches = min(cfg.data.grad_accum_steps or 1, 2)
        with tracker, gpu_policy, attention:
            for i in range(micro_batches):
                if i:
                    tracker.reset_mod_stats()  # the trackers refuse a second forward otherwise
                tracker.phase = "forward"
                last = i == micro_batches - 1
                # As train_step: the sync context around the forward only.
                with gradient_sync(model, last), autocast_context(precision, env.device):
                    loss_sum, _ = loss_sum_and_count(model, batch, cfg.train.loss_chunk_tokens)
                    loss = loss_sum / (tokens * micro_batches)
                tracker.phase = "backward"
                loss.backward()
                del loss, loss_sum
            tracker.phase = "clip"
            clip = cfg.train.grad_clip or float("inf")
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if hasattr(norm, "full_tensor"):
                norm = norm.full_tensor()
            tracker.phase = "optimizer"
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tracker.phase = "done"
        peak = tracker.get_tracker_snapshot("peak")
        raw = next(iter(peak.values()), {})
        raw = {getattr(k, "value", str(k)): int(v) for k, v in raw.items()}
        memory = _categories(raw, comm_at_build, tracker.logits_at_peak, fsdp, framework_bytes(cfg))
        result = TraceResult(
            memory,
            tracker.peak_phase,
            dict(tracker.phase_peaks),
            {k: round(v, 3) for k, v in tracker.phase_seconds.items() if k != "setup"},
            dict(tracker.phase_snaps),
            env.world_size,
            0.0,
            raw,
            notes,
        )
        del model, optimizer, tracker
    return result


@contextlib.contextmanager
def _target_attention(use_gpu: bool) -> Iterator[None]:
    """The attention the target device runs: `auto` resolved for it (not for the
    CPU the trace runs on), and FlexAttention, which has no CPU backward, stood in
    for by SDPA without a mask (`is_causal`): the same tensors kept for backward
    (q, k, v, the output, the log-sum-exp), and no `[T, T]` mask, as FlexAttention
    with its block mask (a few bytes per pair of 128-token blocks, not traced)."""
    import torch.nn.functional as F

    import trainlab.models.attention as attention_pkg
    import trainlab.models.attention.flex as flex
    import trainlab.models.registry as registry

    resolve = registry.resolve_attention

    def for_target(name: str, cuda: bool, dropout: float = 0.0) -> str:
        return resolve(name, use_gpu, dropout)

    def causal(q: Any, k: Any, v: Any, blocks: Any, gqa: bool) -> Any:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    with (
        _patched(registry, "resolve_attention", for_target),
        _patched(flex, "_flex", causal),
        _patched(attention_pkg.AttentionMask, "block", lambda self: None),
    ):
        yield


@contextlib.contextmanager
def _cuda_autocast_norms() -> Iterator[None]:
    """CUDA autocast runs layer_norm/group_norm in fp32 (inputs cast up, fp32
    output); CPU autocast leaves them in the input's dtype. The models' other
    ops are cast alike on both (see the module docstring). `torch.nn.functional`
    is patched rather than a function mode used: activation checkpointing
    recomputes outside function modes."""
    import torch
    import torch.nn.functional as F

    def fp32_under_autocast(fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_autocast_enabled("cpu"):
                return fn(*args, **kwargs)
            with torch.autocast("cpu", enabled=False):
                up = [a.float() if _is_float(a) else a for a in args]
                kw = {k: v.float() if _is_float(v) else v for k, v in kwargs.items()}
                return fn(*up, **kw)

        return wrapped

    with (
        _patched(F, "layer_norm", fp32_under_autocast(F.layer_norm)),
        _patched(F, "group_norm", fp32_under_autocast(F.group_norm)),
    ):
        yield


def _is_float(x: Any) -> bool:
    import torch

    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _current_total(tracker: Any) -> int:
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    return sum(s.get(_TOTAL_KEY, 0) for s in tracker.get_tracker_snapshot().values())


def _bucket_as_result(state, bucket):  # DDP checks `bucket`'s annotation: none
    """DDP comm hook for the fake process group: the all-reduced bucket is the
    bucket itself (the default hook all-reduces it in place)."""
    import torch

    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _use_foreach(optimizer: Any, foreach: bool) -> None:
    """What an optimizer without a fused kernel picks by itself on the target
    device: `foreach` on CUDA. A fused one (AdamW: trainlab.optim.adamw) runs its
    fused CPU kernel here, in place like CUDA's."""
    for opt in (optimizer, getattr(optimizer, "optim", None)):
        if opt is not None and not opt.defaults.get("fused"):
            opt.defaults["foreach"] = foreach
            for group in opt.param_groups:
                if not group.get("fused"):
                    group["foreach"] = foreach


def _categories(
    raw: dict[str, int], comm_at_build: int, logits: int, fsdp: bool, framework: float
) -> dict[str, float]:
    """The tracker's categories in the estimate's names.

    MemTracker: Parameter, Buffer, Gradient, Activation, Temp (backward
    temporaries: activation gradients), Optstate, Other (the snapshot).
    FSDPMemTracker: Sharded/Unsharded Param, Buffer, Sharded/Unsharded Grad,
    Activation, Temp, All Gather, Reduce Scatter, OptState, Inputs.
    DDP's buckets are allocated while the model is wrapped and tracked as
    activations there; they stay for the whole run, so they are moved to
    `communication`. Logits-shaped tensors ([tokens, vocab]) go to `logits_loss`.
    """
    g = raw.get
    mem = dict.fromkeys(CATEGORIES, 0.0)
    if fsdp:
        mem["parameters"] = g("Sharded Param", 0) + g("Unsharded Param", 0) + g("Buffer", 0)
        mem["gradients"] = g("Sharded Grad", 0) + g("Unsharded Grad", 0)
        mem["optimizer"] = g("OptState", 0)
        mem["communication"] = g("All Gather", 0) + g("Reduce Scatter", 0)
        activations = g("Activation", 0) + g("Temp", 0) + g("Inputs", 0)
    else:
        mem["parameters"] = g("Parameter", 0) + g("Buffer", 0)
        mem["gradients"] = g("Gradient", 0)
        mem["optimizer"] = g("Optstate", 0)
        mem["checkpoint_snapshot"] = g("Other", 0)
        mem["communication"] = comm_at_build
        activations = g("Activation", 0) + g("Temp", 0) - comm_at_build
    mem["logits_loss"] = logits
    mem["activations"] = activations - logits
    total = float(g("Total", 0))
    mem["framework"] = framework  # not a tensor: the estimate's constant
    mem["total"] = total + framework
    return mem
