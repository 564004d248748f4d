"""The run's device mesh: where each rank sits in the (pp, dp, tp) layout.

Ranks are laid out pp-major, tp-minor, as in torchtitan and Megatron:

    rank = (pp_rank * dp + dp_rank) * tp + tp_rank

so the tp ranks of a group are consecutive. Ray Train numbers its workers by
node (a node's workers get consecutive ranks), which keeps each tensor-parallel
group, the most communication-hungry, on one node; `check_tp_groups` verifies it
from the hosts the ranks actually run on rather than assuming it. Pipeline
stages, which only pass activations between neighbours, span nodes.

The data-parallel dimension is what FSDP shards over (ZeRO-2/3) and what the
data stream is split by: the ranks of one tensor/pipeline group read the same
rows (trainlab.data.WorkerLoader(spec, dp_rank, dp)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainlab.config.schema import ExperimentConfig

MESH_DIMS = ("pp", "dp", "tp")


@dataclass(frozen=True)
class MeshLayout:
    tp: int = 1
    pp: int = 1
    dp: int = 1

    @classmethod
    def of(cls, cfg: ExperimentConfig) -> MeshLayout:
        """The resolved layout of `cfg` (tp/pp/dp filled by the config rules or the
        planner)."""
        p = cfg.parallel
        tp, pp = p.tp or 1, p.pp or 1
        dp = p.dp or max(1, cfg.resource.num_workers // (tp * pp))
        return cls(tp, pp, dp)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def model_parallel(self) -> bool:
        return self.tp > 1 or self.pp > 1

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of global `rank`."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} not in a world of {self.world_size}")
        return rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank

    def tp_groups(self) -> list[list[int]]:
        """The ranks of every tensor-parallel group."""
        return [
            [self.rank_of(p, d, t) for t in range(self.tp)]
            for p in range(self.pp)
            for d in range(self.dp)
        ]


def check_tp_groups(layout: MeshLayout, hosts: list[str]) -> None:
    """Refuse a rank placement where a tensor-parallel group spans hosts
    (`hosts[r]` is where rank r runs)."""
    if len(hosts) != layout.world_size:
        raise ValueError(f"{len(hosts)} hosts for a world of {layout.world_size}")
    for group in layout.tp_groups():
        where = sorted({hosts[r] for r in group})
        if len(where) > 1:
            raise RuntimeError(
                f"tensor-parallel group of ranks {group} spans hosts {where}: "
                f"parallel.tp ({layout.tp}) must divide the workers per node, and the "
                "cluster must give each node's workers consecutive ranks"
            )


def build_mesh(layout: MeshLayout, device_type: str) -> Any:
    """The DeviceMesh over the initialized process group, dims ("pp", "dp", "tp")
    (sizes 1 included, so every dimension can be asked for by name)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(
        device_type, (layout.pp, layout.dp, layout.tp), mesh_dim_names=MESH_DIMS
    )
