"""Cross-field rules of the experiment config.

Each rule reads the plain dict of already-typed sections, so the loader can run
the rules whose sections validated even when another section is broken, and
report every problem in one go. A rule returns problems; it never raises.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


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
    if parallel.dp is None:
        parallel.dp = max(1, resource.num_workers // (parallel.tp * parallel.pp))
    if parallel.zero_stage is None:
        parallel.zero_stage = 0 if parallel.strategy == "ddp" else 3


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

    arch = find_arch(cfg["model"]["arch"])
    if arch is not None:  # an unknown name is the schema's error
        for issue in arch.check(cfg["model"]):
            yield Problem(issue.path, issue.value, issue.rule)


# --------------------------------------------------------------------------- data/train


@rule("model", "data")
def _seq_len_fits(cfg: dict[str, Any]) -> Iterator[Problem]:
    if cfg["data"]["seq_len"] > cfg["model"]["max_seq_len"]:
        yield Problem(
            "data.seq_len",
            cfg["data"]["seq_len"],
            f"must be <= model.max_seq_len ({cfg['model']['max_seq_len']})",
        )


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
    rank, n = cfg["train"]["chaos"]["kill_rank"], cfg["resource"]["num_workers"]
    if rank >= n:
        yield Problem("train.chaos.kill_rank", rank, f"must be < resource.num_workers ({n})")


# --------------------------------------------------------------------------- parallel


@rule("parallel", "resource")
def _world_size(cfg: dict[str, Any]) -> Iterator[Problem]:
    p, n = cfg["parallel"], cfg["resource"]["num_workers"]
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
def _pp_divides_layers(cfg: dict[str, Any]) -> Iterator[Problem]:
    pp, layers = cfg["parallel"]["pp"], cfg["model"]["num_layers"]
    if pp is not None and layers % pp:
        yield Problem("parallel.pp", pp, f"must divide model.num_layers ({layers})")


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


@rule("parallel")
def _sequence_parallel_needs_tp(cfg: dict[str, Any]) -> Iterator[Problem]:
    p = cfg["parallel"]
    if p["sequence_parallel"] and p["tp"] == 1:
        yield Problem("parallel.sequence_parallel", True, "needs parallel.tp > 1")


# --------------------------------------------------------------------------- resource


@rule("resource")
def _storage_form(cfg: dict[str, Any]) -> Iterator[Problem]:
    storage = cfg["resource"].get("storage")
    if storage is None or "://" not in storage:
        return
    scheme, _, rest = storage.partition("://")
    if scheme not in ("s3", "file"):
        yield Problem(
            "resource.storage",
            storage,
            "must be a filesystem path every node sees or s3://bucket/prefix",
        )
    elif scheme == "s3" and (not rest.split("/")[0] or "?" in rest):
        yield Problem(
            "resource.storage",
            storage,
            "expected s3://bucket/prefix (endpoint via AWS_ENDPOINT_URL, "
            "credentials via AWS_* variables, never in the URI)",
        )
