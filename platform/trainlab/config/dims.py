"""The parallel dimensions of a run, by name: one object, decided once.

`ParallelDims` holds the degrees of each technique (`pp`, `dp`, `tp`; `cp`,
context parallelism, has room and is 1) and answers, by name, everything that
follows from them: the world size, where a rank sits, which ranks form a
tensor-parallel group, whether a layout executes. Every consumer (the config
rules, the planner, the mesh, the data loader's split, checkpoints' layout
record) asks it; nobody reads a positional tuple or recomputes a default.

Ranks are laid out pp-major, tp-minor, as in torchtitan and Megatron:

    rank = (pp_rank * dp + dp_rank) * tp + tp_rank

so the tp ranks of a group are consecutive (trainlab.train.parallel.mesh keeps each on
one host). Data parallelism is DDP's replicas (`dp_replicate`) or FSDP's shards
(`dp_shard`) by the strategy (ZeRO stage 0-1: replicate; 2-3: shard).

Torch-free: `validate` and `plan` use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

# The mesh's dimension names, outermost first (trainlab.train.parallel.mesh.build_mesh).
MESH_DIMS = ("pp", "dp", "tp")


class Coords(NamedTuple):
    """Where one rank sits, by dimension."""

    pp: int
    dp: int
    tp: int


def default_dp(num_workers: int, tp: int, pp: int) -> int:
    """The data-parallel degree when the config leaves it out: the workers left
    once each tensor x pipeline group has its tp * pp of them."""
    return max(1, num_workers // (tp * pp))


def worker_bounds(num_workers: Any) -> tuple[int, int]:
    """(min, max) of `resource.num_workers` as a plain value (an int: a fixed size;
    {min, max}, a dict or a WorkerRange: an elastic run), for rules that read dicts."""
    if isinstance(num_workers, int):
        return num_workers, num_workers
    if isinstance(num_workers, dict):
        return int(num_workers["min"]), int(num_workers["max"])
    return int(num_workers.min), int(num_workers.max)


def layout_executes(tp: int, pp: int, dp: int, zero_stage: int | None) -> str | None:
    """Why the trainer cannot run this layout, or None when it can (the one
    place this is decided: the config rules and the planner ask here)."""
    if zero_stage == 1 and dp > 1 and (tp > 1 or pp > 1):
        return (
            "ZeRO-1 (DDP with a sharded optimizer) does not compose with tp/pp > 1: "
            "use zero_stage 0 (DDP) or strategy fsdp (2, 3)"
        )
    return None


@dataclass(frozen=True)
class ParallelDims:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1  # context parallelism: not yet a technique (always 1)
    zero_stage: int = 0

    @classmethod
    def of(cls, cfg: Any) -> ParallelDims:
        """The dimensions of `cfg` (an ExperimentConfig; `parallel` as resolved by
        the config rules or the planner, else the defaults)."""
        p = cfg.parallel
        tp, pp = p.tp or 1, p.pp or 1
        dp = p.dp or default_dp(cfg.resource.world_size, tp, pp)
        return cls(tp=tp, pp=pp, dp=dp, zero_stage=p.zero_stage or 0)

    # ----------------------------------------------------------------- degrees

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def model_parallel(self) -> bool:
        """Whether a rank holds only part of the model (tp or pp > 1)."""
        return self.tp > 1 or self.pp > 1

    @property
    def dp_shard(self) -> int:
        """FSDP's sharding degree (ZeRO-2/3), else 1."""
        return self.dp if self.zero_stage >= 2 else 1

    @property
    def dp_replicate(self) -> int:
        """DDP's replicas (ZeRO-0/1), else 1."""
        return self.dp if self.zero_stage < 2 else 1

    @property
    def degrees(self) -> dict[str, int]:
        """{dimension: degree} in mesh order."""
        return {name: getattr(self, name) for name in MESH_DIMS}

    @property
    def executes(self) -> bool:
        return layout_executes(self.tp, self.pp, self.dp, self.zero_stage) is None

    # ----------------------------------------------------------------- ranks

    def coords(self, rank: int) -> Coords:
        """Where global `rank` sits."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} not in a world of {self.world_size}")
        return Coords(rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp)

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def tp_groups(self) -> list[list[int]]:
        """The ranks of every tensor-parallel group."""
        return [
            [self.rank_of(p, d, t) for t in range(self.tp)]
            for p in range(self.pp)
            for d in range(self.dp)
        ]
