"""The run's device mesh over its parallel dimensions (trainlab.config.dims).

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

from typing import Any

from trainlab.config.dims import MESH_DIMS, ParallelDims

# The run's layout: trainlab.config.dims.ParallelDims (named degrees, coordinates,
# tensor-parallel groups), under the name this module has always used.
MeshLayout = ParallelDims


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
