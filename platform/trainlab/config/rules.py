"""Cross-field rules of the experiment config.

Each rule reads the plain dict of already-typed sections, so the loader can run
the rules whose sections validated even when another section is broken, and
report every problem in one go. A rule returns problems; it never raises.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from trainlab.config.dims import default_dp, layout_executes, worker_bounds


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config: where, what value, which rule."""

    path: str
    value: Any
    rule: str

    def format(self) -> str:
        return f"{self.path} = {self.value!r}: {self.rule}"


Rule = Callable[[dict[str, Any]], Iterator[Problem]]
RULES: list[tuple[tuple[str, ...], Rule]] = []


def rule(*sections: str) -> Callable[[Rule], Rule]:
    """Register a rule over the given sections (it runs only if they all validated)."""

    def register(fn: Rule) -> Rule:
        RULES.append((sections, fn))
        return fn

    return register


def check_rules(cfg: dict[str, Any]) -> list[Problem]:
    """All problems found by the rules whose sections are present in `cfg`."""
    problems: list[Problem] = []
    for sections, fn in RULES:
        if all(isinstance(cfg.get(s), dict) for s in sections):
            problems.extend(fn(cfg))
    return problems


def resolve_parallel_defaults(parallel: Any, resource: Any) -> None:
    """Fill tp/pp/dp/zero_stage for explicit strategies (auto is left to the planner)."""
    if parallel.strategy == "auto":
        return
    parallel.tp = parallel.tp or 1
    parallel.pp = parallel.pp or 1
    # An elastic run's dp follows its size: left null here, derived per size
    # (ExperimentConfig.at_world_size).
    if parallel.dp is None and not resource.elastic:
        parallel.dp = default_dp(resource.num_workers, parallel.tp, parallel.pp)
    if parallel.zero_stage is None:
        parallel.zero_stage = 0 if parallel.strategy == "ddp" else 3
    if parallel.pp_virtual_stages is None:
        parallel.pp_virtual_stages = 2 if parallel.pp_schedule == "interleaved_1f1b" else 1


def resolve_data_defaults(data: Any, parallel: Any) -> None:
    """Fill grad_accum_steps where it follows from the rest: 1 without a stated global
    batch; global_batch_size / (micro_batch_size x dp) when dp is known. Under
    `strategy: auto` without dp it stays null for the planner (and a value that does
    not divide is left for the rules to report)."""
    if data.grad_accum_steps is not None:
        return
    g, mb, dp = data.global_batch_size, data.micro_batch_size, parallel.dp
    if g is None:
        data.grad_accum_steps = 1
    elif dp is not None and mb != "auto" and g % (mb * dp) == 0:
        data.grad_accum_steps = g // (mb * dp)


# --------------------------------------------------------------------------- model


@rule("model")
def _heads_divide_hidden(cfg: dict[str, Any]) -> Iterator[Problem]:
    m = cfg["model"]
    if m["hidden_size"] % m["num_heads"]:
        yield Problem(
            "model.num_heads", m["num_heads"], f"must divide model.hidden_size ({m['hidden_size']})"
        )


@rule("model")
def _kv_heads(cfg: dict[str, Any]) -> Iterator[Problem]:
    m = cfg["model"]
    kv = m["num_kv_heads"] or m["num_heads"]
    if m["num_heads"] % kv:
        yield Problem("model.num_kv_heads", kv, f"must divide model.num_heads ({m['num_heads']})")


@rule("model")
def _arch_checks(cfg: dict[str, Any]) -> Iterator[Problem]:
    """What only the architecture knows (e.g. RoPE needs an even head dim, gpt2 has
    no grouped-query attention): asked of its file in trainlab.models.archs."""
    from trainlab.models.registry import find_arch

    arch = find_arch(cfg["model"]["arch"], cfg["model"].get("code_dir"))
    if arch is not None:  # an unknown name is the schema's error
        for issue in arch.check(cfg["model"]):
            yield Problem(issue.path, issue.value, issue.rule)


@rule("model")
def _moe(cfg: dict[str, Any]) -> Iterator[Problem]:
    """model.moe's own problems (trainlab.models.moe.moe_checks)."""
    from trainlab.models.moe import moe_checks

    for issue in moe_checks(cfg["model"]):
        yield Problem(issue.path, issue.value, issue.rule)


@rule("parallel", "model")
def _moe_layout(cfg: dict[str, Any]) -> Iterator[Problem]:
    """What an MoE model does not run with yet (docs/moe.md)."""
    p, moe = cfg["parallel"], cfg["model"].get("moe")
    if not moe:
        if (p.get("ep") or 1) > 1:
            yield Problem("parallel.ep", p["ep"], "needs model.moe (experts to split)")
        return
    # tp > 1 runs: the MoE layers stay replicated over the tp group (docs/moe.md)
    if (p["pp"] or 1) > 1:
        yield Problem("parallel.pp", p["pp"], "not with model.moe yet (docs/moe.md)")
    if p.get("sequence_parallel"):
        yield Problem(
            "parallel.sequence_parallel", True,
            "not with model.moe yet: the MoE layers run replicated over tp (docs/moe.md)",
        )  # fmt: skip
    ep, dp = p.get("ep") or 1, p["dp"]
    if ep > 1 and moe["num_experts"] % ep:
        yield Problem(
            "parallel.ep", ep, f"must divide model.moe.num_experts ({moe['num_experts']})"
        )
    if ep > 1 and dp is not None and dp % ep:
        yield Problem("parallel.ep", ep, f"must divide parallel.dp ({dp}): ep borrows dp ranks")
    if ep > 1 and (p["strategy"] == "auto" or p["zero_stage"] == 1):
        yield Problem(
            "parallel.ep", ep,
            "runs with strategy ddp (zero_stage 0) or fsdp (2, 3) for the dense parts; "
            "not with strategy auto or ZeRO-1 yet (docs/moe.md)",
        )  # fmt: skip
    # parallel.activation_checkpointing runs with model.moe: a recomputed MoE block
    # records no routing statistics (trainlab.train.parallel.recompute).


@rule("parallel", "model")
def _layout_of_measured_arch(cfg: dict[str, Any]) -> Iterator[Problem]:
    """An architecture brought by the user (hf:TYPE, MODULE:NAME) is parallelized
    from its structure: data parallelism (DDP, FSDP per repeated block) always;
    tensor parallelism from its own plan (transformers' base_model_tp_plan) when
    trainlab can apply it; pipeline parallelism only where it says how
    (docs/models.md)."""
    from trainlab.models.registry import find_arch

    p, m = cfg["parallel"], cfg["model"]
    arch = find_arch(m["arch"], m.get("code_dir"))
    if arch is None or not arch.measured:
        return
    why = arch.tensor_parallel_refusal(m) if (p["tp"] or 1) > 1 else None
    if why:
        yield Problem("parallel.tp", p["tp"], why)
    if (p["tp"] or 1) > 1 and p.get("sequence_parallel"):
        yield Problem(
            "parallel.sequence_parallel", True,
            f"{arch.name}: sequence parallelism needs the norms' placement, which a "
            "tensor-parallel plan does not give; leave it off",
        )  # fmt: skip
    if (p["pp"] or 1) > 1:
        yield Problem("parallel.pp", p["pp"], arch.pipeline_refusal(m))


@rule("model", "resource")
def _attention_device(cfg: dict[str, Any]) -> Iterator[Problem]:
    """FlexAttention trains on CUDA only (torch has no backward for it on CPU) and
    has no dropout; `auto` picks SDPA where it cannot run (docs/gpu.md)."""
    m = cfg["model"]
    if m["attention"] != "flex":
        return
    if not cfg["resource"]["use_gpu"]:
        yield Problem(
            "model.attention", "flex",
            "FlexAttention has no backward on CPU (torch raises NotImplementedError), so a "
            "CPU training run cannot use it: use auto (SDPA on CPU), sdpa or eager",
        )  # fmt: skip
    elif m["dropout"] > 0:
        yield Problem(
            "model.attention", "flex",
            f"FlexAttention has no dropout (model.dropout = {m['dropout']}): use auto or sdpa",
        )  # fmt: skip


# --------------------------------------------------------------------------- data/train


@rule("model", "data")
def _seq_len_fits(cfg: dict[str, Any]) -> Iterator[Problem]:
    if cfg["data"]["seq_len"] > cfg["model"]["max_seq_len"]:
        yield Problem(
            "data.seq_len",
            cfg["data"]["seq_len"],
            f"must be <= model.max_seq_len ({cfg['model']['max_seq_len']})",
        )


@rule("data", "parallel")
def _global_batch_splits(cfg: dict[str, Any]) -> Iterator[Problem]:
    """global batch = micro_batch_size x grad_accum_steps x dp, in whole numbers."""
    d, dp = cfg["data"], cfg["parallel"]["dp"]
    g, mb, ga = d["global_batch_size"], d["micro_batch_size"], d["grad_accum_steps"]
    if g is None:
        if mb == "auto":
            yield Problem(
                "data.micro_batch_size",
                mb,
                "needs data.global_batch_size (auto splits the stated global batch "
                "into the largest micro batches that fit)",
            )
        return
    sizes = [("data.micro_batch_size", mb), ("data.grad_accum_steps", ga), ("parallel.dp", dp)]
    known = [(name, v) for name, v in sizes if v is not None and v != "auto"]
    prod = 1
    for _, v in known:
        prod *= v
    named = " x ".join(f"{name} ({v})" for name, v in known)
    if len(known) > 1:
        named += f" = {prod}"
    if len(known) == 3 and prod != g:
        yield Problem(
            "data.grad_accum_steps",
            ga,
            f"disagrees with data.global_batch_size ({g}): {named}; give one of the two",
        )
    elif known and g % prod:
        if ga is not None and len(known) > 1:
            yield Problem(
                "data.grad_accum_steps",
                ga,
                f"disagrees with data.global_batch_size ({g}): it is not a multiple of "
                f"{named}; give one of the two",
            )
        else:
            yield Problem("data.global_batch_size", g, f"must be a multiple of {named}")


@rule("train")
def _warmup_before_end(cfg: dict[str, Any]) -> Iterator[Problem]:
    t = cfg["train"]
    if t["warmup_steps"] >= t["total_steps"]:
        yield Problem(
            "train.warmup_steps",
            t["warmup_steps"],
            f"must be < train.total_steps ({t['total_steps']})",
        )


@rule("train")
def _chaos_within_run(cfg: dict[str, Any]) -> Iterator[Problem]:
    t = cfg["train"]
    for k in t["chaos"]["kill_at_steps"]:
        if k >= t["total_steps"]:
            yield Problem(
                "train.chaos.kill_at_steps", k, f"must be < train.total_steps ({t['total_steps']})"
            )
    for key in ("nan_at_steps", "spike_at_steps"):
        for k in t["chaos"][key]:
            if k > t["total_steps"]:
                yield Problem(
                    f"train.chaos.{key}", k, f"must be <= train.total_steps ({t['total_steps']})"
                )


@rule("tracking")
def _alert_routes(cfg: dict[str, Any]) -> Iterator[Problem]:
    alerts = cfg["tracking"]["alerts"]
    known = {"log", "mlflow", *alerts["hooks"]}
    for severity, names in alerts["routes"].items():
        for name in names:
            if name not in known:
                yield Problem(
                    f"tracking.alerts.routes.{severity}",
                    name,
                    f"not a destination (log, mlflow or a hook: {', '.join(sorted(known))})",
                )
    for name, hook in alerts["hooks"].items():
        if name in ("log", "mlflow") or (hook["webhook_url_env"] is None) == (
            hook["command"] is None
        ):
            yield Problem(
                f"tracking.alerts.hooks.{name}",
                "...",
                "a hook (not named log or mlflow) has one of webhook_url_env or command",
            )


@rule("train")
def _skip_windows(cfg: dict[str, Any]) -> Iterator[Problem]:
    t = cfg["train"]
    for first, last in t["skip_steps"]:
        if first > last or last >= t["total_steps"]:
            yield Problem(
                "train.skip_steps",
                [first, last],
                f"a window is [first, last] with first <= last < train.total_steps "
                f"({t['total_steps']})",
            )


@rule("train", "resource")
def _precision_device(cfg: dict[str, Any]) -> Iterator[Problem]:
    if cfg["train"]["precision"] == "fp16" and not cfg["resource"]["use_gpu"]:
        yield Problem(
            "train.precision",
            "fp16",
            "fp16 needs a GPU (resource.use_gpu: true); use bf16 or fp32 on CPU",
        )


@rule("train", "resource")
def _chaos_rank_exists(cfg: dict[str, Any]) -> Iterator[Problem]:
    rank, (n, _) = cfg["train"]["chaos"]["kill_rank"], worker_bounds(cfg["resource"]["num_workers"])
    if rank >= n:
        where = "resource.num_workers.min" if n != _ else "resource.num_workers"
        yield Problem("train.chaos.kill_rank", rank, f"must be < {where} ({n})")


@rule("train")
def _chaos_node_within_run(cfg: dict[str, Any]) -> Iterator[Problem]:
    """kill_node_at_steps: within the run. Whether the cluster has a node besides the
    driver's to lose is known only at launch (trainlab.train.driver.launcher)."""
    t = cfg["train"]
    for k in t["chaos"]["kill_node_at_steps"]:
        if k >= t["total_steps"]:
            yield Problem(
                "train.chaos.kill_node_at_steps",
                k,
                f"must be < train.total_steps ({t['total_steps']})",
            )


# --------------------------------------------------------------------------- elastic


@rule("parallel", "resource", "data")
def _elastic(cfg: dict[str, Any]) -> Iterator[Problem]:
    """An elastic run (num_workers {min, max}) keeps the global batch and the data
    order of a fixed-size run: the global batch is stated, dp and grad accumulation
    follow the size, and every allowed size (a multiple of tp x pp, so tensor and
    pipeline groups stay whole) splits the global batch into whole micro batches."""
    lo, hi = worker_bounds(cfg["resource"]["num_workers"])
    if not isinstance(cfg["resource"]["num_workers"], dict):
        return
    p, d = cfg["parallel"], cfg["data"]
    where = f"an elastic run (resource.num_workers {{min: {lo}, max: {hi}}})"
    if p["dp"] is not None:
        yield Problem("parallel.dp", p["dp"], f"leave it out for {where}: dp follows the size")
    if d["grad_accum_steps"] is not None:
        yield Problem(
            "data.grad_accum_steps",
            d["grad_accum_steps"],
            f"leave it out for {where}: it follows dp, the global batch stays fixed",
        )
    g, mb = d["global_batch_size"], d["micro_batch_size"]
    if g is None:
        yield Problem(
            "data.global_batch_size",
            None,
            f"required for {where}: the global batch and data order stay fixed while dp "
            "changes (grad_accum_steps absorbs it)",
        )
    unit = (p["tp"] or 1) * (p["pp"] or 1)
    sizes = [n for n in range(lo, hi + 1) if n % unit == 0]
    if not sizes:
        yield Problem(
            "resource.num_workers",
            {"min": lo, "max": hi},
            f"no multiple of tp x pp ({unit}) between min and max: tensor and pipeline "
            "groups are never broken",
        )
        return
    if g is None:
        return
    step = mb if isinstance(mb, int) else 1
    for n in sizes:
        dp = n // unit
        if g % (step * dp):
            what = f"data.micro_batch_size ({mb}) x dp" if isinstance(mb, int) else "dp"
            yield Problem(
                "data.global_batch_size",
                g,
                f"must be a multiple of {what} at every allowed size of {where}: at {n} "
                f"workers dp = {dp}",
            )
            return


# --------------------------------------------------------------------------- parallel


@rule("parallel", "resource")
def _world_size(cfg: dict[str, Any]) -> Iterator[Problem]:
    p, n = cfg["parallel"], cfg["resource"]["num_workers"]
    if not isinstance(n, int):
        return  # an elastic run's sizes: _elastic
    tp, pp, dp = p["tp"], p["pp"], p["dp"]
    if None not in (tp, pp, dp):
        if tp * pp * dp != n:
            yield Problem(
                "parallel",
                f"tp={tp} pp={pp} dp={dp}",
                f"tp*pp*dp = {tp * pp * dp} must equal resource.num_workers ({n})",
            )
    else:
        given = [v for v in (tp, pp, dp) if v is not None]
        prod = 1
        for v in given:
            prod *= v
        if n % prod:
            yield Problem(
                "parallel",
                {k: p[k] for k in ("tp", "pp", "dp") if p[k] is not None},
                f"the product of the given sizes ({prod}) must divide resource.num_workers ({n})",
            )


@rule("parallel", "model")
def _pipeline_stages(cfg: dict[str, Any]) -> Iterator[Problem]:
    p, layers = cfg["parallel"], cfg["model"]["num_layers"]
    pp, v = p["pp"] or 1, p["pp_virtual_stages"] or 1
    if pp * v > layers + 2:
        yield Problem(
            "parallel.pp",
            pp,
            f"pp x pp_virtual_stages = {pp * v} stages for {layers} blocks: at most "
            f"model.num_layers + 2 ({layers + 2}; the embedding and the head count as one each)",
        )
    if v > 1 and p["pp_schedule"] != "interleaved_1f1b":
        yield Problem(
            "parallel.pp_virtual_stages",
            v,
            f"more than one stage per rank needs pp_schedule interleaved_1f1b, "
            f"not {p['pp_schedule']}",
        )
    if pp > 1 and v < 2 and p["pp_schedule"] == "interleaved_1f1b":
        yield Problem(
            "parallel.pp_virtual_stages", v, "interleaved_1f1b needs at least 2 stages per rank"
        )


@rule("parallel", "model")
def _tp_divides_heads(cfg: dict[str, Any]) -> Iterator[Problem]:
    tp, m = cfg["parallel"]["tp"], cfg["model"]
    if tp is None:
        return
    kv = m["num_kv_heads"] or m["num_heads"]
    if m["num_heads"] % tp:
        yield Problem("parallel.tp", tp, f"must divide model.num_heads ({m['num_heads']})")
    if kv % tp:
        yield Problem("parallel.tp", tp, f"must divide model.num_kv_heads ({kv})")
    for key in ("ffn_hidden_size", "vocab_size"):
        if m.get(key) and m[key] % tp:
            yield Problem("parallel.tp", tp, f"must divide model.{key} ({m[key]})")


@rule("parallel", "resource")
def _tp_within_node(cfg: dict[str, Any]) -> Iterator[Problem]:
    tp, r = cfg["parallel"]["tp"], cfg["resource"]
    if tp is not None and r["use_gpu"] and tp > r["gpus_per_node"]:
        yield Problem(
            "parallel.tp",
            tp,
            f"tensor parallelism stays within a node: must be <= "
            f"resource.gpus_per_node ({r['gpus_per_node']})",
        )


@rule("parallel")
def _zero_matches_strategy(cfg: dict[str, Any]) -> Iterator[Problem]:
    p = cfg["parallel"]
    z = p["zero_stage"]
    if z is None:
        return
    if p["strategy"] == "ddp" and z not in (0, 1):
        yield Problem(
            "parallel.zero_stage",
            z,
            "strategy ddp runs ZeRO stage 0 or 1; stages 2-3 need strategy fsdp",
        )
    if p["strategy"] == "fsdp" and z not in (2, 3):
        yield Problem(
            "parallel.zero_stage",
            z,
            "strategy fsdp shards gradients (stage 2) or everything (stage 3); "
            "stages 0-1 need strategy ddp",
        )


# What the trainer executes (trainlab.train.parallel): an explicit layout that cannot
# run is refused at `trainlab validate`, not at launch.


@rule("parallel", "train")
def _layout_executes(cfg: dict[str, Any]) -> Iterator[Problem]:
    p = cfg["parallel"]
    why = layout_executes(p["tp"] or 1, p["pp"] or 1, p["dp"] or 1, p["zero_stage"])
    if why:
        yield Problem("parallel.zero_stage", p["zero_stage"], why)
    if (p["pp"] or 1) > 1 and cfg["train"]["precision"] == "fp16":
        yield Problem(
            "train.precision",
            "fp16",
            "pipeline parallelism runs without a loss scaler: use bf16 (or fp32)",
        )


def pipeline_microbatches(
    rows: int, micro_batch_size: int, pp: int, given: int | None
) -> int | None:
    """Micro batches per step through a pipeline of `pp` ranks over `rows` rows per
    data-parallel rank: `given`, else the step's data micro batches when there are
    at least pp, else the smallest divisor of rows that is >= pp (None if none)."""
    if given is not None:
        return given
    data_mbs = max(1, rows // micro_batch_size)
    if data_mbs >= pp:
        return data_mbs
    return next((n for n in range(pp, rows + 1) if rows % n == 0), None)


@rule("parallel", "data")
def _pipeline_microbatches(cfg: dict[str, Any]) -> Iterator[Problem]:
    p, d = cfg["parallel"], cfg["data"]
    pp, dp, mbs = p["pp"] or 1, p["dp"], d["micro_batch_size"]
    if pp < 2 or dp is None or mbs == "auto":
        return
    g = d["global_batch_size"] or mbs * (d["grad_accum_steps"] or 1) * dp
    rows = g // dp
    n = pipeline_microbatches(rows, mbs, pp, p["pp_microbatches"])
    where = f"{rows} rows per data-parallel rank"
    if n is None:
        yield Problem(
            "parallel.pp_microbatches", None, f"no count >= pp ({pp}) divides the {where}"
        )
        return
    if rows % n:
        yield Problem("parallel.pp_microbatches", n, f"must divide the {where}")
    if p["pp_schedule"] == "1f1b" and n < pp:
        yield Problem("parallel.pp_microbatches", n, f"1f1b needs at least pp ({pp})")
    rounds = max(1, n // pp)
    if p["pp_schedule"] == "interleaved_1f1b" and n % rounds:
        yield Problem(
            "parallel.pp_microbatches",
            n,
            f"interleaved_1f1b needs a multiple of max(1, n // pp) = {rounds}",
        )


@rule("parallel", "model", "data")
def _sequence_parallel(cfg: dict[str, Any]) -> Iterator[Problem]:
    p = cfg["parallel"]
    if not p["sequence_parallel"]:
        return
    tp = p["tp"]
    if tp is not None and tp < 2:
        yield Problem(
            "parallel.sequence_parallel",
            True,
            "shards over the tensor-parallel ranks: needs parallel.tp > 1",
        )
    if cfg["model"]["arch"] == "gpt2":
        yield Problem(
            "parallel.sequence_parallel",
            True,
            "is not supported with learned positions (model.arch gpt2)",
        )
    seq = cfg["data"]["seq_len"]
    if tp and seq % tp:
        yield Problem(
            "parallel.sequence_parallel",
            True,
            f"parallel.tp ({tp}) must divide data.seq_len ({seq})",
        )


def _location_form(key: str, value: str, local: str) -> Iterator[Problem]:
    """A location `key` may hold: a local path (`local` says which), s3:// or gs://
    (trainlab.location.form_problem); any other scheme would be taken for nothing
    readable later, credentials never go in it."""
    from trainlab.location import form_problem

    problem = form_problem(value, local)
    if problem is not None:
        yield Problem(key, *problem)


@rule("data")
def _data_path_form(cfg: dict[str, Any]) -> Iterator[Problem]:
    """data.path: a local directory or a dataset in a store (trainlab.data.location)."""
    yield from _location_form("data.path", cfg["data"]["path"], "a local directory")


@rule("train")
def _runs_root_form(cfg: dict[str, Any]) -> Iterator[Problem]:
    """train.runs_root: a directory or a store (trainlab.run.location), checked before a
    run directory could be made of it."""
    yield from _location_form(
        "train.runs_root",
        cfg["train"]["runs_root"],
        "a directory (shared by every node for multi-node runs)",
    )
