"""This process's place in the worker group, and the few collectives the loop
needs. Every helper also works in a single process without a process group
(unit tests, one-worker runs without torch.distributed).

With tensor or pipeline parallelism (`layout`, trainlab.train.parallel.mesh) the ranks
of one model replica share a data-parallel rank: they read the same rows, and
only one of them (`owns_loss`: tp rank 0 of the last pipeline stage) counts
the replica's loss in reductions over the world.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from trainlab.config.dims import Coords
from trainlab.train.parallel.mesh import MeshLayout


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    layout: MeshLayout = field(default_factory=MeshLayout)
    mesh: Any = None  # torch DeviceMesh with dims ("pp", "dp", "tp"); None in one process

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    @property
    def coords(self) -> Coords:
        """Where this rank sits (pp, dp, tp), by name."""
        if self.layout.world_size != self.world_size:  # a plain data-parallel world
            return Coords(pp=0, dp=self.rank, tp=0)
        return self.layout.coords(self.rank)

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def dp_size(self) -> int:
        return self.layout.dp if self.layout.world_size == self.world_size else self.world_size

    @property
    def owns_loss(self) -> bool:
        at = self.coords
        return at.tp == 0 and at.pp == self.layout.pp - 1

    def group(self, dim: str) -> Any:
        """The process group of mesh dimension `dim` ("pp", "dp" or "tp")."""
        return self.mesh.get_group(dim)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def replica_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over data-parallel replicas of values every rank computed for its
        replica (each replica counted once)."""
        if not self.owns_loss:
            t = torch.zeros_like(t)
        return self.all_reduce_sum(t)

    def dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel ranks of this rank's replica group."""
        if not self.distributed:
            return t
        if self.mesh is not None:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group("dp"))
        else:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank `src`'s `obj` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()
