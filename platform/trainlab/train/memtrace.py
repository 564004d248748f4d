"""Memory of one real training step, traced at full size without allocating it.

`trace_memory(cfg, layout)` builds the model trainlab builds (`build_model`),
wraps it with the trainer's own code (`trainlab.train.parallel`: `parallelize`,
`build_optimizer` per part, `gradient_sync`, `clip_grad_norm`;
`trainlab.train.loop.step`: `autocast_context`, `loss_sum_and_count`,
`loss_parallel` under tensor parallelism) and runs one optimizer step the way
`train_step_tensors` does (per micro batch: forward and loss under the sync
context and autocast, backward; with pipeline parallelism the schedule over
the step's rows instead, then the tied table's gradient sum; then gradient
clipping, the optimizer step, `zero_grad(set_to_none=True)`), as rank 0 of a
world of the layout's size (with pp > 1: as each pipeline rank in turn, below),
on a packed batch as the loader makes it (position and document ids: attention
gets the block-diagonal mask). The step function itself is not called: it
takes the trainer's ModelState and the loader's host batches. With:

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

Tensor parallelism (tp > 1): the DeviceMesh ("pp", "dp", "tp") is built on the
fake process group before fake mode, as the trainer builds it, and
`parallelize` shards the model over its "tp" dimension (DTensor); rank 0 (tp
rank 0) is traced, the other tp ranks holding the same shapes. The trackers
count DTensors by their local shards. The loss runs under `loss_parallel` on
the vocabulary-sharded logits, forward and backward, as `train_step_tensors`
runs it. FSDP or FSDP2's replicate over "dp" beside tp joins the dp and tp
meshes inside fake mode; the joined mesh's rank table is computed outside the
modes (`DeviceMesh._concatenate`).

Pipeline parallelism (pp > 1): the real schedule (`PipelinePlan.run`:
torch.distributed.pipelining's 1F1B, GPipe or interleaved 1F1B, with the
configured number of pipeline micro batches) runs one rank's stages, every
forward and backward in the schedule's order, so the stages hold what that
rank holds in flight (1F1B: pp - r micro batches on pipeline rank r). Each
pipeline rank is traced in turn, in a fake world of its own (as its tp=0,
dp=0 rank), and the busiest is the result (`TraceResult.rank`, with every
pipeline rank's total in `rank_totals`). What is stood in for, the peers being
absent:

- the activations and gradients a rank receives: the fake process group's
  send and receive return at once; the received tensors are the schedule's
  own receive buffers (fake), of the shapes the schedule inferred;
- the schedule's first step (not traced, as the optimizer state's creation is
  not): its vote over the ranks on how to learn the stages' shapes (a tensor
  read back) is what every rank votes for trainlab's stages (inferred at run
  time); the metadata the inference sends goes nowhere, and the metadata it
  receives is made here: a stage's input is the first stage's output (kept
  from pipeline rank 0's trace, which runs first: every stage passes on the
  residual stream), the gradient of its output has its output's shape. The
  receive buffers that step allocates (one per micro batch, activations and
  gradients) stay, and count as `communication`;
- cutting a stage deep-copies the model, which gives fake tensors a fake mode
  of their own: the copy is made under torch's FakeCopyMode.
Several stages per rank (interleaved 1F1B) under FSDP are refused:
FSDPMemTracker follows one FSDP module and one optimizer.
The trackers' per-module statistics, which the trace does not read, refuse a
module's second forward in a step (each micro batch's): they are skipped
(MemTracker) or restarted (FSDPMemTracker); what sets a tensor's category
(a module's parameters, recomputation in backward) is kept. Where the peak of
a schedule is, forward or backward, is read from the module tracker.

The trace leaves no global state behind: the fake process groups are destroyed,
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
    rank: int = 0  # the traced rank (pp > 1: the busiest pipeline rank)
    rank_totals: dict[int, float] = field(default_factory=dict)  # pp > 1: each pipeline rank's


def trace_memory(
    cfg: ExperimentConfig, layout: Any = None, micro_batch: int | None = None
) -> dict[str, float]:
    """The traced peak memory of rank 0 (pp > 1: of the busiest pipeline rank) by
    category (the names of `trainlab.plan.memory.memory_breakdown`) plus `total`,
    in bytes.

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
    from trainlab.config.dims import ParallelDims, layout_executes

    why = layout_executes(layout.tp, layout.pp, layout.dp, layout.zero_stage)
    if why:
        raise UserError(f"trace: tp={layout.tp} pp={layout.pp} dp={layout.dp}: {why}")
    run_cfg = layout_config(cfg, layout)
    mb = int(micro_batch or cfg.data.micro_batch_size)
    dims = ParallelDims(tp=layout.tp, pp=layout.pp, dp=layout.dp, zero_stage=layout.zero_stage)
    t0 = time.perf_counter()
    # Pipeline ranks hold different stages: each is traced (tp=0, dp=0 of each; the
    # other tp and dp ranks hold the same shapes) and the busiest is the result.
    # Rank 0 goes first: its first stage's output is what the others receive.
    hidden: dict[str, Any] = {}
    results = []
    for pp_rank in range(dims.pp):
        with _experts_as_on_gpu(run_cfg), _fake_world(dims, dims.rank_of(pp_rank, 0, 0)) as env:
            results.append(_trace(run_cfg, env, mb, hidden))
    result = max(results, key=lambda r: r.memory["total"])
    if dims.pp > 1:
        result.rank_totals = {r.rank: r.memory["total"] for r in results}
        result.notes.append(
            "pp > 1: every pipeline rank traced; the figures are the busiest's (rank "
            f"{result.rank}): "
            + ", ".join(f"rank {r.rank} {r.memory['total'] / 2**30:.3f} GiB" for r in results)
        )
    result.seconds = time.perf_counter() - t0
    return result


@contextlib.contextmanager
def _experts_as_on_gpu(cfg: ExperimentConfig) -> Iterator[None]:
    """A mixture of experts (model.moe) is traced as the GPU bf16 run it plans: its
    experts take `torch._grouped_mm`, whose meta kernel runs on fake tensors (the
    CPU's paths read row counts back, data fake tensors do not have). Routing on
    fakes is balanced in shape only: a dropless layer's rows are tokens x top_k
    whatever the choice, as the estimate has them. Other MoE targets are refused in
    one line."""
    if cfg.model.moe is None:
        yield
        return
    if not (cfg.resource.use_gpu and cfg.train.precision == "bf16"):
        raise UserError(
            "trace: a mixture of experts (model.moe) is traced as a GPU bf16 run "
            "(resource.use_gpu: true, train.precision: bf16); its CPU paths read row "
            "counts back, which fake tensors do not have"
        )
    if (cfg.parallel.ep or 1) > 1:
        raise UserError(
            f"trace: parallel.ep = {cfg.parallel.ep} is not traced (the all-to-all reads "
            "its split sizes back); the plan counts ep from the trainer's rules (docs/moe.md)"
        )
    import torch

    import trainlab.models.moe.experts as experts

    real = experts.grouped_mm_available
    experts.grouped_mm_available = lambda x: (
        experts.compute_dtype(x) == torch.bfloat16 and hasattr(torch, "_grouped_mm")
    )
    try:
        yield
    finally:
        experts.grouped_mm_available = real


# --------------------------------------------------------------------------- the fake world


@contextlib.contextmanager
def _fake_world(dims: Any, rank: int = 0) -> Iterator[Any]:
    """A fake process group of `dims`' world size (trainlab.config.dims.ParallelDims)
    with this process as `rank` (none for a single device), and the rank's DistEnv:
    with tensor or pipeline parallelism on the run's device mesh, built here,
    before fake mode, as the trainer builds it (trainlab.train.supervision.child);
    torn down on exit."""
    import torch
    import torch.distributed as dist

    from trainlab.train.parallel.distributed import DistEnv
    from trainlab.train.parallel.mesh import build_mesh

    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "trace: a torch.distributed process group is already initialized in this "
            "process; trace in a process of its own"
        )
    world_size, cpu = dims.world_size, torch.device("cpu")
    if world_size == 1:
        yield DistEnv(rank=0, world_size=1, local_rank=0, device=cpu)
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        if dims.model_parallel:
            env = DistEnv(rank, world_size, 0, cpu, dims, build_mesh(dims, cpu.type))
        else:  # as the trainer: a plain data-parallel world, no mesh
            env = DistEnv(rank=rank, world_size=world_size, local_rank=0, device=cpu)
        yield env
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    """`obj.name` set to `value`, then restored as it was (a staticmethod stays one;
    an inherited attribute is inherited again)."""
    missing = object()
    original = vars(obj).get(name, missing)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if original is missing:
            delattr(obj, name)
        else:
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
    from torch.distributed.device_mesh import DeviceMesh
    from torch.utils._python_dispatch import _disable_current_modes

    concatenate = DeviceMesh._concatenate

    def concatenate_outside_modes(meshes: Any) -> Any:
        with _disable_current_modes():
            return concatenate(meshes)

    with contextlib.ExitStack() as stack:
        # FSDP beside tp joins the dp and tp meshes inside fake mode: the new mesh's
        # rank table is computed from the real one, outside the modes.
        stack.enter_context(
            _patched(DeviceMesh, "_concatenate", staticmethod(concatenate_outside_modes))
        )
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
            phase = self.phase
            if phase == "schedule":  # a pipeline schedule runs forward and backward in turn
                phase = "backward" if self._mod_tracker.is_bw else "forward"
            for dev, snap in self._curr_mem_snap.items():
                if self.phase_peaks is not None and snap[_TOTAL_KEY] > self.phase_peaks.get(
                    phase, -1
                ):
                    self.phase_peaks[phase] = snap[_TOTAL_KEY]
                    self.phase_snaps[phase] = {
                        getattr(k, "value", k): v for k, v in snap.items()
                    } | {"logits": self.logits_now}
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)
                    self.peak_phase = phase
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
        # A module's forward runs again within the step (a pipeline stage once per
        # micro batch; every module with gradient accumulation): the tracker's
        # per-module statistics, which the trace does not read, refuse that. Only
        # what sets the categories is kept: a module's first forward tracks its
        # parameters (gradients as gradients), a forward inside backward is
        # recomputation (activations, not backward temporaries).
        def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
            if module not in self.memory_tracking or self._mod_tracker.is_bw:
                super()._pre_fw_hook(module, inputs)

        def _post_fw_hook(self, module: Any, inputs: Any, outputs: Any) -> None:
            if self._mod_tracker.is_bw and self._ac_mod is not None and self._ac_mod() is module:
                self._ac_mod, self._in_ac = None, False

        def _pre_bw_hook(self, module: Any, args: Any) -> None:
            pass

        def _post_bw_hook(self, module: Any, args: Any) -> None:
            pass

    class LeanFSDP(_Lean, FSDPMemTracker):
        # As Lean's: an FSDP module's forward again within the step (a pipeline
        # stage's next micro batch) starts its statistics afresh.
        def _fsdp_state_pre_forward(self, fsdp_mod: Any, orig: Any) -> Any:
            inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)

            def again(*args: Any, **kwargs: Any) -> Any:
                if not self._mod_tracker.is_bw:
                    self.memory_tracking.pop(fsdp_mod, None)
                return inner(*args, **kwargs)

            return again

    return Lean, LeanFSDP


def _trace(
    cfg: ExperimentConfig, env: Any, micro_batch: int, hidden: dict[str, Any] | None = None
) -> TraceResult:
    """One rank's step. `hidden` carries what the first pipeline stage sends on (the
    metadata of its output) from rank 0's trace to the other pipeline ranks'."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainlab.models import arch_of, build_model
    from trainlab.train.loop.step import autocast_context, concat, loss_sum_and_count
    from trainlab.train.parallel import (
        build_optimizer,
        clip_grad_norm,
        gradient_sync,
        parallelize,
    )
    from trainlab.train.parallel.pipeline import is_tied_copy

    Lean, LeanFSDP = _trackers()
    fsdp = cfg.parallel.strategy == "fsdp" and env.distributed
    dims = env.layout if env.mesh is not None else None
    tp = dims.tp if dims is not None else 1
    pp = dims.pp if dims is not None else 1
    notes: list[str] = []
    seq, vocab = cfg.data.seq_len, cfg.model.vocab_size
    measuring = arch_of(cfg.model).measuring()
    pipelined = _pipeline_under_fakes(hidden if hidden is not None else {}) if pp > 1 else None
    with (
        _trainer_under_fakes(fsdp and dims is None, env.world_size),
        FakeTensorMode(),
        measuring,
        pipelined or contextlib.nullcontext(),
    ):
        if fsdp:
            pm = parallelize(build_model(cfg.model), cfg, env)
            if len(pm.parts) > 1:
                raise UserError(
                    "trace: several pipeline stages per rank (interleaved) under FSDP: "
                    "torch's FSDPMemTracker follows one FSDP module and one optimizer"
                )
            optimizers = [build_optimizer(pm.parts[0], cfg, env)]
            tracker = LeanFSDP(pm.parts[0], optimizers[0])
            comm_at_build = 0
        else:
            # Built under the tracker: DDP allocates its gradient buckets here.
            tracker = Lean()
            with tracker:
                model = build_model(cfg.model)
                tracker.track_external(model)
                before = _current_total(tracker)
                pm = parallelize(model, cfg, env)
                del model  # pipeline stages hold copies of their part of it
                optimizers = [build_optimizer(part, cfg, env) for part in pm.parts]
                if pm.sharded:
                    # tp shards and pp stages are new parameters (the whole model's
                    # freed): as parameters; what else stays is communication's.
                    tracker.track_external(*pm.parts)
                    comm_at_build = _current_total(tracker, exclude=("Parameter", "Buffer"))
                else:
                    comm_at_build = _current_total(tracker) - before
            for part in pm.parts:
                if hasattr(part, "register_comm_hook"):  # DDP on the fake process group
                    part.register_comm_hook(None, _bucket_as_result)
        for optimizer in optimizers:
            _use_foreach(optimizer, cfg.resource.use_gpu)
            cfg.train.optimizer.create_state(optimizer)  # the state of step 2 onwards
        # Checkpoints (DCP, async or not) stage to host memory: nothing on the device.
        if not fsdp:
            for optimizer in optimizers:
                tracker.track_external(optimizer, getattr(optimizer, "optim", None))
        pipeline = pm.pipeline
        accum = cfg.data.grad_accum_steps or 1
        # Gradient accumulation: from the second micro batch on, the step starts with
        # the gradients of the earlier ones; two show the steady state. A pipeline
        # takes the step's rows at once and splits them into its own micro batches.
        micro_batches = 1 if pipeline is not None else min(accum, 2)
        rows = micro_batch * accum if pipeline is not None else micro_batch
        tokens = (rows // pipeline.microbatches if pipeline is not None else rows) * seq
        chunk = min(cfg.train.loss_chunk_tokens or tokens, tokens)
        # Logits, [tokens, vocab / tp]: tensor parallelism shards the vocabulary.
        tracker.logits_shape = (tokens, vocab // tp)
        # The chunked loss's fp32 chunks are the loss's too (trainlab.models.loss).
        tracker.logits_rows = {tokens, chunk, tokens % chunk} - {0}
        tracker.phase_peaks, tracker.phase_seconds, tracker.phase_snaps = {}, {}, {}
        tracker.phase = "setup"
        # A packed batch as the loader makes it (trainlab.data.pack): with
        # position and document ids, so attention gets its block-diagonal mask.
        batch = {
            "input_ids": torch.zeros((rows, seq), dtype=torch.long),
            "labels": torch.zeros((rows, seq), dtype=torch.long),
            "position_ids": torch.zeros((rows, seq), dtype=torch.long),
            "document_ids": torch.zeros((rows, seq), dtype=torch.int32),
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
            and any(isinstance(m, norms) for part in pm.parts for m in part.modules())
        )
        gpu_policy = _cuda_autocast_norms() if emulate else contextlib.nullcontext()
        attention = _target_attention(cfg.resource.use_gpu)
        loss_context = contextlib.nullcontext
        if pm.tensor_parallel:  # as train_step: forward and backward inside it
            from torch.distributed.tensor.parallel import loss_parallel as loss_context
        if pipeline is not None:
            # The trainer's first step, not traced: the schedule infers its stages'
            # inputs and outputs (a forward and an autograd.grad of its own, which
            # the tracker's module hooks do not allow) and allocates its receive
            # buffers, which stay: tracked from here, as communication.
            scale = torch.ones((), dtype=torch.float32) / (rows * seq)
            first_step = (
                _cuda_autocast_norms() if emulate else contextlib.nullcontext(),
                _target_attention(cfg.resource.use_gpu),
                loss_context(),
                autocast_context(precision, env.device),
            )
            with contextlib.ExitStack() as stack:
                for ctx in first_step:
                    stack.enter_context(ctx)
                pipeline.run(concat([batch]), scale, backward=True)
            for part in pm.parts:
                part.zero_grad(set_to_none=True)
            comm_at_build += _track_as_activations(tracker, _receive_buffers(pipeline))
        with tracker, gpu_policy, attention:
            if pipeline is not None:
                tracker.phase = "schedule"  # forward and backward in the schedule's order
                with loss_context():
                    with autocast_context(precision, env.device):
                        pipeline.run(concat([batch]), scale, True, cfg.train.loss_chunk_tokens)
                    pipeline.sync_tied_gradients()
            for i in range(micro_batches if pipeline is None else 0):
                if i:
                    tracker.reset_mod_stats()  # the trackers refuse a second forward otherwise
                tracker.phase = "forward"
                last = i == micro_batches - 1
                model = pm.parts[0]
                # As train_step: the sync context around the forward only.
                with loss_context():
                    with gradient_sync(model, last), autocast_context(precision, env.device):
                        loss_sum, _ = loss_sum_and_count(model, batch, cfg.train.loss_chunk_tokens)
                        loss = loss_sum / (tokens * micro_batches)
                    tracker.phase = "backward"
                    loss.backward()
                del loss, loss_sum, model
            tracker.phase = "clip"
            clip = cfg.train.grad_clip or float("inf")
            if pm.sharded:  # as train_step: norms over meshes and stages
                params = [p for part in pm.parts for p in part.parameters()]
                tied: frozenset[int] = frozenset()
                if pipeline is not None:  # a tied table's second copy (ModelState.tied_copies)
                    tied = frozenset(id(p.output.weight) for p in pm.parts if is_tied_copy(p))
                group = pipeline.group if pipeline is not None else None
                norm = clip_grad_norm(params, clip, group, tied)
            else:
                norm = torch.nn.utils.clip_grad_norm_(pm.parts[0].parameters(), clip)
                if hasattr(norm, "full_tensor"):
                    norm = norm.full_tensor()
            del norm
            tracker.phase = "optimizer"
            for optimizer in optimizers:
                optimizer.step()
            for optimizer in optimizers:
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
            env.rank,
        )
        del pm, pipeline, optimizers, tracker
    return result


def _receive_buffers(pipeline: Any) -> list[Any]:
    """The buffers a pipeline rank's stages receive activations and gradients into,
    one per micro batch each (torch.distributed.pipelining's `_RecvInfo`)."""
    schedule = pipeline.schedule
    buffers = []
    for stage in schedule._stages if hasattr(schedule, "_stages") else [schedule._stage]:
        for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
            buffers += [i.buffer for i in infos if getattr(i, "buffer", None) is not None]
    return buffers


def _track_as_activations(tracker: Any, tensors: list[Any]) -> int:
    """Track `tensors`, made outside the tracker, as activations; their bytes."""
    act = next(r for r in tracker._ref_class if r.value == "Activation")
    seen: set[int] = set()
    total = 0
    for t in tensors:
        for winfo in tracker._update_and_maybe_create_winfos(t, act):
            if id(winfo) not in seen:
                seen.add(id(winfo))
                total += winfo.mem_consumed
    return total


@contextlib.contextmanager
def _pipeline_under_fakes(hidden: dict[str, Any]) -> Iterator[None]:
    """What the pipeline schedule (torch.distributed.pipelining) needs to run one
    rank on fakes, its peers being absent (see the module docstring):

    - cutting a stage deep-copies the model; a deep copy of a fake tensor gets a
      fake mode of its own (torch's FakeCopyMode keeps the active one);
    - the schedule's first step votes over the ranks (a tensor read back) for
      inferring the stages' input and output shapes at run time: what every rank
      votes without shapes given, as trainlab's stages are built;
    - that inference sends each stage's output metadata to the next stage and
      its input-gradient metadata to the previous one: sent, nothing happens (the
      first stage's output is kept in `hidden` for the other ranks' traces);
      received, a stage gets the first stage's output (every stage passes the
      residual stream on: the same tensor) or gradients shaped as its own outputs.
    The activations and gradients themselves go through the fake process group's
    send and receive, which return at once into the schedule's own buffers."""
    import copy
    import dataclasses
    import types

    from torch._guards import active_fake_mode
    from torch._subclasses.fake_tensor import FakeCopyMode
    from torch.distributed.pipelining import schedules, stage
    from torch.distributed.pipelining._utils import (
        InferenceMode,
        _StageBackwardMeta,
        _StageForwardMeta,
    )

    import trainlab.train.parallel.pipeline as pipeline_mod

    def deepcopy(obj: Any, memo: Any = None) -> Any:
        with FakeCopyMode(active_fake_mode()):
            return copy.deepcopy(obj, memo)

    def warmup_p2p(self: Any, stages: Any, has_backward: bool, p2p_done: bool) -> None:
        for s in stages if isinstance(stages, list) else [stages]:
            s._inference_mode = InferenceMode.DYNAMIC

    def send_meta(self: Any, meta: Any, dst_stage: int) -> None:
        if isinstance(meta, _StageForwardMeta) and self.stage_index == 0:
            hidden["forward"] = meta.forward_metas

    def recv_meta(self: Any, src_stage: int) -> Any:
        if src_stage < self.stage_index:
            if "forward" not in hidden:
                raise RuntimeError("trace: pipeline rank 0 is traced first")
            return _StageForwardMeta(hidden["forward"])
        grads = tuple(
            dataclasses.replace(m, requires_grad=False) if m.requires_grad else None
            for m in self._stage_meta.outputs
        )
        return _StageBackwardMeta(grads)

    with contextlib.ExitStack() as stack:
        stack.enter_context(
            _patched(pipeline_mod, "copy", types.SimpleNamespace(deepcopy=deepcopy))
        )
        stack.enter_context(_patched(schedules._PipelineSchedule, "_warmup_p2p", warmup_p2p))
        stack.enter_context(_patched(stage.PipelineStage, "_send_meta", send_meta))
        stack.enter_context(_patched(stage.PipelineStage, "_recv_meta", recv_meta))
        yield


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


def _current_total(tracker: Any, exclude: tuple[str, ...] = ()) -> int:
    """Bytes the tracker holds now, less its categories named in `exclude`."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    total = 0
    for snap in tracker.get_tracker_snapshot().values():
        total += snap.get(_TOTAL_KEY, 0)
        total -= sum(v for k, v in snap.items() if getattr(k, "value", k) in exclude)
    return total


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
        mem["communication"] = g("All Gather", 0) + g("Reduce Scatter", 0) + comm_at_build
        activations = g("Activation", 0) + g("Temp", 0) + g("Inputs", 0) - comm_at_build
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
