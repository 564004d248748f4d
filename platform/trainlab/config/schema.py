"""The experiment schema: one pydantic v2 model per config section.

Every field has a type, a default and bounds; unknown keys are errors
(`extra="forbid"`). Rules that involve more than one field live in
`trainlab.config.rules`, so they can be checked even when another section is
broken and every problem is reported at once.

Adding a field: put it in its section with a default, a bound and a one-line
comment saying what it does; if it interacts with another field, add a rule.
"""

from __future__ import annotations

import warnings
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from trainlab.optim import OptimizerConfig

PosInt = Annotated[int, Field(ge=1)]
# Marks a field that is not part of the experiment's identity (its config hash):
# it describes the record or how and where the run operates, not what is trained
# (trainlab.config.loader.identity_dict). A run resumes with another value.
NOT_IDENTITY: dict[str, bool] = {"identity": False}
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$"
# "package.module:function"
IMPORT_PATH = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"


def module_on_path(module: str) -> bool:
    """Whether the dotted `module` can be imported, found without importing it or
    any package above it (importlib.util.find_spec imports the parents, running
    their __init__.py): the top level through the installed finders, each level
    below by its files in its package's folders (`_find_below`), or a module
    already imported."""
    import sys
    from importlib.util import find_spec

    if sys.modules.get(module) is not None:
        return True  # imported already (also os.path: not a file below os)
    parts = module.split(".")
    search: list[str] | None = None
    for depth, part in enumerate(parts, 1):
        loaded = sys.modules.get(".".join(parts[:depth]))
        if loaded is not None:
            below = getattr(loaded, "__path__", None)
        elif depth == 1:
            spec = find_spec(part)  # a top-level name: asks the finders, imports nothing
            if spec is None:
                return False
            below = spec.submodule_search_locations
        else:
            found, below = _find_below(part, search or [])
            if not found:
                return False
        if depth < len(parts) and below is None:
            return False  # a module, not a package: nothing below it
        search = list(below) if below is not None else None
    return True


def _find_below(part: str, folders: list[str]) -> tuple[bool, list[str] | None]:
    """Whether `part` is in a package whose folders are `folders`, as the import
    system would find it, and where its own submodules are: (True, [folder]) for a
    package (`part/__init__.py`), (True, None) for a module (`part.py`, `.pyc`, an
    extension), (True, portions) for a namespace package (folders without
    __init__.py), else (False, None)."""
    import os
    from importlib.machinery import all_suffixes

    portions = []
    for folder in folders:
        base = os.path.join(folder, part)
        if any(os.path.isfile(os.path.join(base, "__init__" + s)) for s in all_suffixes()):
            return True, [base]
        if any(os.path.isfile(base + s) for s in all_suffixes()):
            return True, None
        if os.path.isdir(base):
            portions.append(base)
    return (True, portions) if portions else (False, None)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


# --------------------------------------------------------------------------- model


class MoERouterConfig(Section):
    # The experts' scores: softmax over experts (Switch, Mixtral, Qwen3-MoE) or a
    # sigmoid per expert (DeepSeek-V3).
    score: Literal["softmax", "sigmoid"] = "softmax"
    # Rescale the chosen top_k experts' weights to sum 1.
    normalize_top_k: bool = True


class MoEConfig(Section):
    """Mixture of experts on a SwiGLU family (docs/moe.md): MoE layers replace
    the MLP of every `every_n_layers`-th block after `first_dense_layers`."""

    num_experts: int = Field(8, ge=2, le=4096)
    # Routed experts per token (token choice).
    top_k: int = Field(2, ge=1, le=256)
    # One expert's hidden width; null = model.ffn_hidden_size.
    expert_ffn_hidden_size: int | None = Field(None, ge=8, le=1_048_576)
    # Experts every token goes through besides its routed ones (width: that many experts').
    shared_experts: int = Field(0, ge=0, le=64)
    first_dense_layers: int = Field(0, ge=0, le=1024)
    every_n_layers: int = Field(1, ge=1, le=1024)
    router: MoERouterConfig = Field(default_factory=MoERouterConfig)
    # Load balancing: an auxiliary loss (Switch), a per-expert routing bias moved once
    # per optimizer step from the step's counts (aux-loss-free, DeepSeek-V3), or none.
    balance: Literal["aux_loss", "bias", "none"] = "aux_loss"
    aux_loss_coef: float = Field(0.01, ge=0.0, le=10.0)
    bias_update_rate: float = Field(0.001, gt=0.0, le=1.0)
    # Rows an expert takes per forward: capacity_factor x tokens x top_k / num_experts
    # (assignments past it are dropped); null = dropless.
    capacity_factor: float | None = Field(None, gt=0.0, le=64.0)


class ModelConfig(Section):
    """A decoder-only LM. `arch` names a trainlab family (one file each in
    trainlab/models/archs/: `gpt2`: learned positions, LayerNorm, GELU MLP,
    biases; `llama`: RoPE, RMSNorm, SwiGLU MLP, grouped-query attention, no
    biases; `llama_qknorm`: llama with per-head q/k RMSNorm), a transformers
    family `hf:MODEL_TYPE`, or the user's own `MODULE:NAME` (docs/models.md)."""

    # Where MODULE of `arch: MODULE:NAME` is imported from: by default the folder of
    # the config file that names it (trainlab.config.loader); else the Python path.
    code_dir: str | None = Field(None, json_schema_extra=NOT_IDENTITY)
    # Architecture: a family's name, hf:MODEL_TYPE or MODULE:NAME (docs/models.md).
    arch: str = "llama"
    hidden_size: int = Field(256, ge=8, le=65536)
    num_layers: int = Field(4, ge=1, le=1024)
    num_heads: int = Field(4, ge=1, le=1024)
    # Key/value heads for grouped-query attention; null means num_heads (plain MHA).
    num_kv_heads: int | None = Field(None, ge=1, le=1024)
    # MLP width; null means the architecture's default: 4*hidden (gpt2) or
    # 8/3*hidden rounded up to 256 (llama).
    ffn_hidden_size: int | None = Field(None, ge=1, le=1_048_576)
    vocab_size: int = Field(8192, ge=2, le=4_194_304)
    max_seq_len: int = Field(1024, ge=1, le=1_048_576)
    tie_embeddings: bool = True
    # Attention implementation, by name (see trainlab.models.attention): auto (FlexAttention
    # with a block mask on CUDA, SDPA on CPU: docs/gpu.md), sdpa, flex (CUDA training), eager.
    attention: str = Field("auto", pattern=r"^[a-z][a-z0-9_]*$")
    norm_eps: float = Field(1e-5, gt=0, le=1e-2)
    rope_theta: float = Field(10000.0, gt=0)
    init_std: float = Field(0.02, gt=0, le=1.0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    # The architecture's own fields: for hf:TYPE any field of its transformers config
    # class; for MODULE:NAME what its options_model declares. Checked at validate.
    options: dict[str, Any] = Field(default_factory=dict)
    # Accept an architecture that cannot keep packed documents apart (layers that
    # carry state along the row): its documents see each other in this run.
    cross_document_attention: bool = False
    # Mixture of experts (docs/moe.md); null: a dense model.
    moe: MoEConfig | None = None

    @field_validator("arch")
    @classmethod
    def _known_arch(cls, name: str, info: ValidationInfo) -> str:
        from trainlab.models.registry import find_arch, unknown_arch_message

        code_dir = info.data.get("code_dir")
        if find_arch(name, code_dir) is None:
            raise ValueError(unknown_arch_message(name, code_dir))
        return name

    @field_validator("attention")
    @classmethod
    def _known_attention(cls, name: str) -> str:
        import difflib

        from trainlab.models.registry import attention_names

        known = attention_names()
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"unknown attention; {hint}available: {', '.join(known)}")
        return name

    @model_validator(mode="after")
    def _fill_defaults(self) -> ModelConfig:
        from trainlab.models.registry import arch_of

        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = arch_of(self).default_ffn_hidden_size(self)
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


# --------------------------------------------------------------------------- data


class DataConfig(Section):
    # Directory written by `trainlab prep` (holds manifest.json); relative to the repo root.
    path: str = "data/demo/prepared"
    seq_len: int = Field(256, ge=8, le=1_048_576)
    # Sequences per device per forward/backward; `auto` (needs global_batch_size): the
    # planner picks the largest that fits (see trainlab.plan.planner).
    micro_batch_size: Annotated[int, Field(ge=1, le=65536)] | Literal["auto"] = Field(
        8, json_schema_extra=NOT_IDENTITY
    )
    # Micro batches per optimizer step; null = derived: global_batch_size /
    # (micro_batch_size x dp) when global_batch_size is set (by the planner under
    # `strategy: auto`), else 1.
    grad_accum_steps: int | None = Field(None, ge=1, le=65536, json_schema_extra=NOT_IDENTITY)
    # Sequences per optimizer step; null = micro_batch_size x grad_accum_steps x dp (varies with dp).
    global_batch_size: int | None = Field(None, ge=1, le=16_777_216)
    # Token shares per source name (normalized to sum 1); empty means every
    # source in the manifest in proportion to its token count.
    mix: dict[str, Annotated[float, Field(gt=0, le=1e6)]] = Field(default_factory=dict)
    seed: int = Field(1234, ge=0, le=2**31 - 1)
    # A source smaller than its share is repeated; more epochs than this is a config error.
    max_epochs_per_source: float = Field(10.0, gt=0, le=10_000)
    # Fraction of each source's documents held out for validation (by document).
    val_fraction: float = Field(0.01, ge=0.0, le=0.5)
    # Logical CPUs the Ray Data read/mix/pack pipeline may use (caps its resources).
    loader_cpus: float = Field(1.0, gt=0, le=1024, json_schema_extra=NOT_IDENTITY)
    # Ray Data's per-dataset metrics (the dashboard's Data panel), pushed by the
    # training loader every few seconds. Off by default: the pushes and the stats
    # actor's work take CPU from training on a small machine.
    ray_data_metrics: bool = Field(False, json_schema_extra=NOT_IDENTITY)
    # Resume even if the prepared dataset's fingerprint differs from the checkpoint's.
    allow_fingerprint_change: bool = False


# --------------------------------------------------------------------------- train


# `validate` is a name users write (train.checkpoint.validate); it shadows pydantic's
# deprecated BaseModel.validate classmethod, which nothing here uses.
warnings.filterwarnings("ignore", message='Field name "validate"', category=UserWarning)


class CheckpointConfig(Section):
    every_steps: int = Field(100, ge=1)
    keep_last: int = Field(2, ge=1, le=1000)
    keep_best: int = Field(1, ge=0, le=1000)
    async_save: bool = False
    # Load every saved checkpoint into a fresh CPU model and run one forward.
    validate: bool = True
    # A Ctrl-C stops at the next step and saves one there only when the newest
    # checkpoint (or the run's start) is at least this old; 0 = always save.
    on_interrupt_min_age_s: float = Field(60.0, ge=0.0)


class ChaosConfig(Section):
    # Hard-kill one worker process the first time each of these steps is reached.
    kill_at_steps: list[PosInt] = Field(default_factory=list)
    kill_rank: int = Field(0, ge=0)
    # Rehearse a lost node: at each of these steps (once per run) the raylet of a node
    # other than the driver's that hosts a training worker is killed (SIGKILL), with
    # every process on it. Needs a multi-node cluster (checked at launch).
    kill_node_at_steps: list[PosInt] = Field(default_factory=list)
    # Rehearse P0 handling: step k's loss becomes NaN (every rank), or is multiplied by
    # spike_factor (a gradient-norm spike); each fires once per run directory.
    nan_at_steps: list[PosInt] = Field(default_factory=list)
    spike_at_steps: list[PosInt] = Field(default_factory=list)
    spike_factor: float = Field(1000.0, gt=1.0)


def _optimizer_union() -> object:
    """`train.optimizer`'s type: the registered optimizers' config classes, told
    apart by `name` (a pydantic discriminated union built from trainlab.optim's
    registry, so a new optimizer is one new file there)."""
    from trainlab.optim import optimizer_classes

    classes = tuple(optimizer_classes())
    if len(classes) == 1:
        return classes[0]
    return Annotated[Union[classes], Field(discriminator="name")]  # noqa: UP007


OptimizerSection = _optimizer_union()
# Fields that moved from `train` into `train.optimizer`: at `train` they are refused
# with their new name (docs/optimizers.md).
MOVED_TO_OPTIMIZER = ("weight_decay", "beta1", "beta2", "eps")


def _default_optimizer() -> OptimizerConfig:
    from trainlab.optim.adamw import AdamWConfig

    return AdamWConfig()


class TrainConfig(Section):
    lr: float = Field(3e-4, gt=0, le=1.0)
    # Cosine decay ends at min_lr_ratio * lr.
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    warmup_steps: int = Field(100, ge=0)
    total_steps: int = Field(1000, ge=1, le=100_000_000)
    # The optimizer, by name, with its own fields (one file each in trainlab/optim/):
    # `adamw` (the default) or `muon`; e.g. {name: muon, momentum: 0.95}.
    optimizer: OptimizerSection = Field(default_factory=_default_optimizer)
    # Clip the global gradient norm to this value; 0 disables clipping.
    grad_clip: float = Field(1.0, ge=0.0)
    precision: Literal["fp32", "fp16", "bf16"] = "fp32"
    # torch.compile each transformer block (after recomputation, before FSDP); auto: on
    # CUDA only (on CPU it compiles for tens of seconds and runs no faster: docs/gpu.md).
    compile: Literal["auto", "true", "false"] = Field("auto", json_schema_extra=NOT_IDENTITY)
    # Tokens per chunk of the cross-entropy: each chunk's logits go to fp32 on their own,
    # never the whole micro batch's (2048 x a 128k vocabulary: 1 GiB); 0 = one chunk.
    loss_chunk_tokens: int = Field(2048, ge=0, le=1_048_576, json_schema_extra=NOT_IDENTITY)
    log_interval: int = Field(10, ge=1, json_schema_extra=NOT_IDENTITY)
    # Validation loss per source every eval_interval steps, over eval_batches batches.
    eval_interval: int = Field(100, ge=1)
    eval_batches: int = Field(2, ge=1, le=10_000)
    seed: int = Field(0, ge=0, le=2**31 - 1)
    # Seed everything and use deterministic algorithms: runs become bitwise reproducible.
    deterministic: bool = False
    # Worker-group restarts Ray Train may do before the run fails.
    max_failures: int = Field(3, ge=0, le=1000, json_schema_extra=NOT_IDENTITY)
    # Where run directories go: {runs_root}/{date}/{name}/. Relative paths here and in
    # data.path: to the config file's repository root (config.loader). Or s3://bucket/prefix:
    # runs then live in object storage, each node keeps only a cache (resource.scratch_dir).
    runs_root: str = Field("runs", json_schema_extra=NOT_IDENTITY)
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, json_schema_extra=NOT_IDENTITY
    )
    # Windows [first, last] of steps (1-based, inclusive) whose batches are not trained
    # on: the step counter passes over them, the data stream stays addressed by step.
    # What rollback_and_skip does after an anomaly, given up front (docs/monitoring.md).
    skip_steps: list[tuple[PosInt, PosInt]] = Field(default_factory=list)
    chaos: ChaosConfig = Field(default_factory=ChaosConfig, json_schema_extra=NOT_IDENTITY)
    # More parts of the training loop, by import path "package.module:factory" with
    # factory(cfg) -> list of trainlab.train.loop.components.Component; they run on every
    # rank after the built-in ones, before checkpointing (docs/contracts.md).
    components: list[Annotated[str, Field(pattern=IMPORT_PATH)]] = Field(
        default_factory=list, max_length=64
    )

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_word(cls, value: object) -> object:
        """YAML's true/false (booleans) mean "true"/"false"."""
        return str(value).lower() if isinstance(value, bool) else value

    @field_validator("components")
    @classmethod
    def _components_importable(cls, paths: list[str]) -> list[str]:
        """The module of each path must exist (found by its files, not imported:
        reading a config runs no code of the packages it names)."""
        for path in paths:
            module = path.partition(":")[0]
            try:
                found = module_on_path(module)
            except (ImportError, ValueError):
                found = False
            if not found:
                raise ValueError(f"{path!r}: no module {module!r} on the Python path")
        return paths

    @model_validator(mode="before")
    @classmethod
    def _optimizer_fields(cls, data: object) -> object:
        """`train.optimizer` without a name is AdamW's; `train.beta1` (and the other
        fields that moved, MOVED_TO_OPTIMIZER) are refused with their new name."""
        if not isinstance(data, dict):
            return data
        moved = sorted(k for k in MOVED_TO_OPTIMIZER if k in data)
        if moved:
            raise ValueError(
                f"train.{moved[0]} is now train.optimizer.{moved[0]} (docs/optimizers.md)"
            )
        opt = data.get("optimizer")
        if not (isinstance(opt, dict) and "name" not in opt):
            return data
        return {**data, "optimizer": {**opt, "name": "adamw"}}


# --------------------------------------------------------------------------- parallel


class ParallelConfig(Section):
    """`auto`: the planner fills tp/pp/dp/zero_stage (values given here constrain
    it). ZeRO stage 0 and 1 run as DDP (1 with a sharded optimizer), 2 and 3 as FSDP.
    tp (tensor) and pp (pipeline) parallelism compose with either (docs/parallelism.md)."""

    strategy: Literal["auto", "ddp", "fsdp"] = "auto"
    tp: int | None = Field(None, ge=1, le=1024)
    pp: int | None = Field(None, ge=1, le=1024)
    dp: int | None = Field(None, ge=1, le=1_000_000)
    zero_stage: int | None = Field(None, ge=0, le=3)
    # Recompute blocks in backward: none, selective (every other block), full, or auto
    # (the planner tries none -> selective -> full and takes the first that fits).
    activation_checkpointing: Literal["none", "selective", "full", "auto"] = "none"
    # With tp > 1: shard the residual stream, norms and dropout over the sequence too.
    sequence_parallel: bool = False
    # Pipeline schedule (pp > 1): gpipe, 1f1b, or interleaved_1f1b (virtual stages).
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    # Micro batches per step through the pipeline; null = the data micro batches of
    # a step (rows per data-parallel rank / data.micro_batch_size).
    pp_microbatches: int | None = Field(None, ge=1, le=65536)
    # Stages per pipeline rank; null = 2 for interleaved_1f1b, else 1.
    pp_virtual_stages: int | None = Field(None, ge=1, le=64)
    # Expert parallelism (model.moe, docs/moe.md): the routed experts split over ep
    # data-parallel ranks, tokens sent to them by all-to-all (ep divides dp and
    # model.moe.num_experts); null = 1.
    ep: int | None = Field(None, ge=1, le=4096)


# --------------------------------------------------------------------------- resource


class WorkerRange(Section):
    """An elastic run's bounds (`resource.num_workers: {min: M, max: N}`): it starts
    with as many workers as Ray can place, at most N, continues smaller after a lost
    node (never below M) and grows back when capacity returns (docs/elastic.md)."""

    min: int = Field(..., ge=1, le=100_000)
    max: int = Field(..., ge=1, le=100_000)

    @model_validator(mode="after")
    def _ordered(self) -> WorkerRange:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must be <= max ({self.max})")
        return self


def _worker_count_kind(value: object) -> str:
    return "range" if isinstance(value, (dict, WorkerRange)) else "fixed"


# `resource.num_workers`: an int, or a mapping read as a WorkerRange (one error
# for a wrong range, not one per member of the union).
WorkerCount = Annotated[
    Union[  # noqa: UP007
        Annotated[Annotated[int, Field(ge=1, le=100_000)], Tag("fixed")],
        Annotated[WorkerRange, Tag("range")],
    ],
    Discriminator(_worker_count_kind),
]
# Union member labels pydantic puts in an error's path; not what the user writes.
UNION_TAGS = frozenset({"fixed", "range"})


class ResourceConfig(Section):
    # Ray Train workers = devices (one GPU each when use_gpu). An int is a fixed size;
    # {min: M, max: N} an elastic run (docs/elastic.md): read the size as `world_size`.
    num_workers: WorkerCount = 1
    # Elastic runs: how often (seconds) Ray Train looks for capacity to grow the run by.
    resize_check_s: float = Field(60.0, ge=0.0, le=86_400.0)
    # Elastic runs: how long (seconds) a restart after a loss waits for at least
    # num_workers.min workers before the attempt fails (resource.job_retries applies).
    below_min_wait_s: float = Field(60.0, ge=0.0, le=86_400.0)
    use_gpu: bool = False
    gpu_memory_gb: float = Field(80.0, gt=0, le=4096)
    # GPUs (= workers) per node: tensor parallelism stays within one; the plan's `nodes`.
    gpus_per_node: int = Field(8, ge=1, le=64)
    cpus_per_worker: float = Field(1.0, gt=0, le=1024)
    # Memory per CPU worker for planning; null means host RAM / workers on this host.
    cpu_memory_gb: float | None = Field(None, gt=0, le=65536)
    # Peak dense TFLOP/s of one device at the training precision, for MFU; null = unknown.
    peak_tflops: float | None = Field(None, gt=0, le=100_000)
    # Logical CPUs of the embedded local Ray cluster; null = max(8, 2*cores) so that
    # training workers and Ray Data never starve each other (see docs/ray-resources.md).
    local_num_cpus: int | None = Field(None, ge=1, le=4096)
    # `trainlab submit`: resubmit a job that failed for infrastructure reasons.
    job_retries: int = Field(0, ge=0, le=100)
    # Each node's local scratch and cache area (staged checkpoint parts, downloaded
    # checkpoints and datasets, the driver's working copy of a run kept in object
    # storage): never the only copy of anything. An absolute path on every node;
    # null = {the node's temp dir}/trainlab-scratch (TMPDIR decides; trainlab.nodedisk).
    scratch_dir: str | None = Field(
        None, min_length=1, max_length=1024, json_schema_extra=NOT_IDENTITY
    )

    @property
    def elastic(self) -> bool:
        """Whether the run's size is a range (`num_workers: {min, max}`)."""
        return isinstance(self.num_workers, WorkerRange)

    @property
    def min_workers(self) -> int:
        n = self.num_workers
        return n.min if isinstance(n, WorkerRange) else n

    @property
    def max_workers(self) -> int:
        n = self.num_workers
        return n.max if isinstance(n, WorkerRange) else n

    @property
    def world_size(self) -> int:
        """The number of workers the run asks for: the fixed size, or an elastic run's
        max (what it starts with when Ray can place them). The one place the size is
        read as a number; a training worker's config is pinned to its actual size
        (`ExperimentConfig.at_world_size`)."""
        return self.max_workers

    def allowed_world_sizes(self, unit: int = 1) -> list[int]:
        """The sizes the run may have: the multiples of `unit` (tp x pp: tensor and
        pipeline groups are never broken) between min and max."""
        return [n for n in range(self.min_workers, self.max_workers + 1) if n % unit == 0]

    @field_validator("scratch_dir")
    @classmethod
    def _scratch_is_local_and_absolute(cls, v: str | None) -> str | None:
        if v is None:
            return v
        from trainlab.location import disk_only_problem

        if disk_only_problem(v):
            raise ValueError(disk_only_problem(v))
        if not (v.startswith("/") or v.startswith("~")):
            raise ValueError("an absolute path (it names a directory on every node)")
        return v


# --------------------------------------------------------------------------- tracking


Severity = Literal["P0", "P1", "P2"]


class AlertRule(Section):
    enabled: bool = True
    severity: Severity = "P1"
    # Steps a condition must hold (or the averaging window) before the rule fires.
    window: int = Field(1, ge=1, le=1_000_000)
    # Steps after firing during which the same rule stays quiet.
    cooldown: int = Field(100, ge=0, le=1_000_000)


class NonFiniteRule(AlertRule):
    severity: Severity = "P0"
    window: int = Field(1, ge=1, le=1_000_000)


class LossRisingRule(AlertRule):
    severity: Severity = "P1"
    # The loss's moving average (over `smoothing` steps) has risen over the last `window`
    # steps by more than its noise (5 standard errors; see trainlab.monitor.rules).
    window: int = Field(50, ge=1, le=1_000_000)
    smoothing: int = Field(20, ge=1, le=1_000_000)


class GradSpikeRule(AlertRule):
    severity: Severity = "P1"
    # Fires when grad norm > factor * its running mean over `window` steps.
    factor: float = Field(10.0, gt=1.0)
    window: int = Field(100, ge=1, le=1_000_000)


class ThroughputDropRule(AlertRule):
    severity: Severity = "P2"
    # Fires when tokens/s stays below fraction * its running median for `window` steps.
    fraction: float = Field(0.5, gt=0.0, lt=1.0)
    window: int = Field(20, ge=1, le=1_000_000)


class StaleCheckpointRule(AlertRule):
    severity: Severity = "P1"
    # Fires when no valid checkpoint has been written for this many minutes.
    minutes: float = Field(30.0, gt=0)


class LowDiskRule(AlertRule):
    severity: Severity = "P1"
    # Fires when the run directory's filesystem has less than this many GiB free
    # (measured on every logged step; trainlab.monitor.disk).
    min_free_gb: float = Field(5.0, ge=0)


class ExpertImbalanceRule(AlertRule):
    severity: Severity = "P1"
    # An MoE (model.moe): some layer's busiest expert above factor x the mean load, or
    # more than dead_fraction of its experts without a token, for `window` steps.
    factor: float = Field(3.0, gt=1.0)
    dead_fraction: float = Field(0.25, ge=0.0, lt=1.0)
    window: int = Field(50, ge=1, le=1_000_000)


class RouterCollapseRule(AlertRule):
    # An MoE: some layer's top_k busiest experts take >= share of its tokens for
    # `window` steps. P1 by default; as P0 it pages (judged on logged steps, rank 0).
    severity: Severity = "P1"
    share: float = Field(0.9, gt=0.0, le=1.0)
    window: int = Field(20, ge=1, le=1_000_000)


ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


class AlertHook(Section):
    """An alert destination besides the run log and MLflow: a webhook whose URL is in
    the environment variable named here, or a command (argv, no shell) that gets the
    alert as JSON on stdin. Variables named here are secrets: `submit` carries them
    to the job outside its runtime env, and they are never recorded."""

    webhook_url_env: str | None = Field(None, pattern=ENV_NAME)
    command: list[str] | None = Field(None, min_length=1)
    # Variables the command needs from the submitting machine (carried like the URL).
    env: list[Annotated[str, Field(pattern=ENV_NAME)]] = Field(default_factory=list)


def _default_hooks() -> dict[str, AlertHook]:
    return {
        "page": AlertHook(webhook_url_env="TRAINLAB_PAGE_WEBHOOK"),
        "message": AlertHook(webhook_url_env="TRAINLAB_MESSAGE_WEBHOOK"),
    }


def _default_routes() -> dict[str, list[str]]:
    return {
        "P0": ["log", "mlflow", "page", "message"],
        "P1": ["log", "mlflow", "message"],
        "P2": ["log", "mlflow"],
    }


class AlertsConfig(Section):
    non_finite: NonFiniteRule = Field(default_factory=NonFiniteRule)
    loss_rising: LossRisingRule = Field(default_factory=LossRisingRule)
    grad_spike: GradSpikeRule = Field(default_factory=GradSpikeRule)
    throughput_drop: ThroughputDropRule = Field(default_factory=ThroughputDropRule)
    stale_checkpoint: StaleCheckpointRule = Field(default_factory=StaleCheckpointRule)
    low_disk: LowDiskRule = Field(default_factory=LowDiskRule)
    expert_imbalance: ExpertImbalanceRule = Field(default_factory=ExpertImbalanceRule)
    router_collapse: RouterCollapseRule = Field(default_factory=RouterCollapseRule)
    # HTTP POST target for alerts. Give the *name* of an environment variable holding
    # the URL (secrets stay out of configs), e.g. TRAINLAB_ALERT_WEBHOOK.
    webhook_url_env: str | None = Field(None, pattern=ENV_NAME)
    # Named destinations, and which go to each severity ("log" and "mlflow" are
    # built in): P0 pages, P1 sends a message, P2 is only recorded. A webhook whose
    # variable is unset delivers nothing (logged once). webhook_url_env, when set,
    # is the "message" hook's variable.
    hooks: dict[str, AlertHook] = Field(default_factory=_default_hooks)
    routes: dict[Severity, list[str]] = Field(default_factory=_default_routes)
    # What a P0 alert does besides notifying (decided on every rank at the same step):
    # nothing; stop (resume point: the newest valid checkpoint; exit code 4); or reload
    # the newest valid checkpoint before the anomaly and skip the steps since.
    on_p0: Literal["notify", "checkpoint_and_stop", "rollback_and_skip"] = "notify"
    # rollback_and_skip: rollbacks allowed per run; the next P0 stops the run.
    max_rollbacks: int = Field(3, ge=0, le=1000)

    def secret_env_names(self) -> list[str]:
        """The environment variables the hooks name: secrets, carried to a submitted
        job outside its runtime env and never recorded (trainlab.redact)."""
        names = [self.webhook_url_env] if self.webhook_url_env else []
        for hook in self.hooks.values():
            names += [hook.webhook_url_env] if hook.webhook_url_env else []
            names += list(hook.env)
        return sorted(set(names))


class TrackingConfig(Section):
    # MLflow experiment; null means the recipe family (the top-level recipe file's stem).
    experiment: str | None = Field(None, min_length=1, max_length=250)
    # Copy checkpoints into MLflow artifacts (otherwise they are referenced by path).
    log_checkpoints: bool = False
    # MLflow system metrics (CPU, memory, GPU when present).
    system_metrics: bool = True
    alerts: AlertsConfig = Field(default_factory=AlertsConfig)


# --------------------------------------------------------------------------- experiment


class ExperimentConfig(Section):
    """One experiment: what to train, on what, how, where, and why."""

    name: str = Field(
        ..., min_length=1, max_length=100, pattern=NAME_PATTERN, json_schema_extra=NOT_IDENTITY
    )
    # The experiment record the team keeps for every run.
    purpose: str = Field("", json_schema_extra=NOT_IDENTITY)
    expectation: str = Field("", json_schema_extra=NOT_IDENTITY)
    owner: str = Field("", json_schema_extra=NOT_IDENTITY)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    parallel: ParallelConfig = Field(
        default_factory=ParallelConfig, json_schema_extra=NOT_IDENTITY
    )
    resource: ResourceConfig = Field(
        default_factory=ResourceConfig, json_schema_extra=NOT_IDENTITY
    )
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig, json_schema_extra=NOT_IDENTITY
    )

    @field_validator("purpose", "expectation", "owner")
    @classmethod
    def _no_credentials_in_free_text(cls, text: str) -> str:
        """A URL's credentials in the experiment record's free text are masked as the
        config is read, so config.yaml, the MLflow params and config artifact and the
        tracking journal all hold the same masked text (docs/security.md)."""
        from trainlab.redact import redact

        return redact(text)

    @model_validator(mode="after")
    def _cross_field(self) -> ExperimentConfig:
        from trainlab.config.rules import (
            check_rules,
            resolve_data_defaults,
            resolve_parallel_defaults,
        )

        resolve_parallel_defaults(self.parallel, self.resource)
        resolve_data_defaults(self.data, self.parallel)
        problems = check_rules(self.model_dump())
        if problems:
            raise ValueError("; ".join(p.format() for p in problems))
        return self

    # Derived quantities used everywhere; kept here so no one re-derives them.
    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step across all data-parallel ranks: the stated
        data.global_batch_size, else micro_batch_size x grad_accum_steps x dp."""
        d = self.data
        if d.global_batch_size is not None:
            return d.global_batch_size
        from trainlab.config.dims import ParallelDims

        dp = ParallelDims.of(self).dp
        # Without a stated global batch the rules make micro_batch_size an int and the
        # validator fills grad_accum_steps (1 unless given).
        return int(d.micro_batch_size) * (d.grad_accum_steps or 1) * dp

    @property
    def pipeline_microbatches(self) -> int | None:
        """Micro batches per step through the pipeline (pp > 1): parallel.pp_microbatches,
        else the step's data micro batches when there are at least pp of them, else
        the smallest divisor of the rows per data-parallel rank that is >= pp. None
        when the rows per rank are not known yet or none divides."""
        from trainlab.config.rules import pipeline_microbatches

        p = self.parallel
        if p.dp is None or self.data.micro_batch_size == "auto":
            return p.pp_microbatches
        rows = self.global_batch_size // p.dp
        return pipeline_microbatches(
            rows, int(self.data.micro_batch_size), p.pp or 1, p.pp_microbatches
        )

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.data.seq_len

    def at_world_size(self, n: int) -> ExperimentConfig:
        """This config at the fixed size `n`: what a training worker of an elastic run
        trains with once Ray placed `n` workers (dp and grad_accum_steps re-derived,
        the global batch unchanged). A fixed-size config at its own size is itself;
        trainlab.errors.ConfigError when the config does not hold at `n`."""
        from pydantic import ValidationError

        from trainlab.errors import ConfigError

        if not self.resource.elastic and self.resource.num_workers == n:
            return self
        d = self.model_dump()
        d["resource"]["num_workers"] = n
        if self.resource.elastic:  # dp and grad accumulation follow the size
            d["parallel"]["dp"] = None
            d["data"]["grad_accum_steps"] = None
        try:
            return ExperimentConfig.model_validate(d)
        except ValidationError as e:
            why = [str(err["msg"]).removeprefix("Value error, ") for err in e.errors()]
            raise ConfigError([f"at {n} workers: {w}" for w in why]) from None


SECTIONS: dict[str, type[Section]] = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "parallel": ParallelConfig,
    "resource": ResourceConfig,
    "tracking": TrackingConfig,
}
