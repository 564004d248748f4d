"""Expert parallelism (`parallel.ep`, dp2ep): the routed experts of every MoE
layer (trainlab.models.moe) split over `ep` data-parallel ranks, tokens sent to
their experts' ranks and back by all-to-all.

`ep` borrows from the data-parallel ranks (as torchtitan's dp2ep): every rank
still reads its own rows; the dp ranks are grouped into `dp/ep` groups of
`ep` consecutive dp ranks (the named dims ("edp", "ep") of `expert_mesh`), at a
fixed (pp, tp) coordinate: with tensor parallelism each tp rank of a group
holds its own (the same) copy of its experts (the MoE layer is replicated over
tp, trainlab.train.parallel.tensor), exchanged with the ranks of its ep group
only, whose tp coordinate is the same. Within
an ep group each rank holds num_experts/ep experts (its contiguous block), as
DTensors sharded on dim 0 over the ep mesh: checkpoints (DCP) hold the whole
expert tensors by name and reshard across ep degrees like every other layout.

The dense parts stay data-parallel over all dp ranks (DDP or FSDP2, each told
to leave the experts alone). An expert's gradient gathers, through the
all-to-all's backward, every token of its ep group routed to it; `sync_grads`
sums it over the ranks holding the same experts (edp) and divides it by dp,
which is what DDP's average gives the replicated experts at ep = 1: the same
training, up to float summation order (tests/unit/train/test_expert_parallel.py).

The token exchange of one MoE layer (`AllToAll`): the per-expert counts go
first (all_to_all_single over the ep group, and one host read for the split
sizes), then the rows, which arrive grouped by source rank and are re-sorted
by local expert for the grouped GEMM; the outputs take the reverse path.
Both row exchanges are torch's autograd all-to-all (functional collectives).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainlab.models.moe.experts import GroupedExperts
from trainlab.models.moe.layer import MoE, moe_layers

EXPERT_MESH_DIMS = ("pp", "edp", "ep", "tp")


def expert_mesh(dp: int, ep: int, device_type: str, pp: int = 1, tp: int = 1) -> Any:
    """The DeviceMesh of the world as (pp, dp/ep, ep, tp), the run's mesh
    (trainlab.train.parallel.mesh: rank = (pp_rank * dp + dp_rank) * tp + tp_rank)
    with its dp dimension split as dp_rank = edp_rank * ep + ep_rank: "ep" groups
    ep consecutive dp ranks at one (pp, tp) coordinate (one all-to-all group),
    "edp" the ranks holding the same experts there."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (pp, dp // ep, ep, tp), mesh_dim_names=EXPERT_MESH_DIMS)


class AllToAll:
    """Runs an MoE layer's sorted rows through the experts of their ep ranks."""

    def __init__(self, group: Any, ep: int, num_experts: int):
        self.group, self.ep, self.local = group, ep, num_experts // ep

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> Any:
        from torch.distributed._functional_collectives import (
            all_to_all_single_autograd,
            wait_tensor,
        )

        def exchange(t: torch.Tensor, out_sizes: list[int], in_sizes: list[int]) -> Any:
            return wait_tensor(all_to_all_single_autograd(t, out_sizes, in_sizes, self.group))

        ep, local = self.ep, self.local
        got = torch.empty_like(counts)  # [ep * local]: from each source, per my expert
        dist.all_to_all_single(got, counts, group=self.group)
        send = counts.view(ep, local).sum(1).tolist()
        recv_by_source = got.view(ep, local)
        recv = recv_by_source.sum(1).tolist()
        arrived = exchange(rows, recv, send)
        expert_of_row = torch.repeat_interleave(
            torch.arange(local, device=rows.device).repeat(ep),
            got,
            output_size=arrived.shape[0],
        )
        order = expert_of_row.argsort(stable=True)
        out = experts(arrived[order], recv_by_source.sum(0))
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return exchange(out[back], send, recv)


def _shard_experts(experts: GroupedExperts, mesh: Any) -> None:
    """Keep this rank's block of experts, as a DTensor of the whole (Shard(0))."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    for name in ("gate", "up", "down"):
        whole = getattr(experts, name)
        local = distribute_tensor(whole.detach(), mesh, [Replicate()]).redistribute(
            mesh, [Shard(0)]
        )
        setattr(experts, name, nn.Parameter(local))
    experts.num_experts = experts.gate.to_local().shape[0]


def apply(
    model: nn.Module, ep: int, dp: int, device_type: str, pp: int = 1, tp: int = 1
) -> EPState:
    """Split the experts of `model` (built whole, the same on every rank) over the
    ep ranks and route their tokens by all-to-all. Returns what the step needs.
    `pp`, `tp`: the run's other degrees (the world is pp x dp x tp)."""
    mesh = expert_mesh(dp, ep, device_type, pp, tp)
    ep_mesh = mesh["ep"]
    names = []
    for layer_name, layer in model.named_modules():
        if not isinstance(layer, MoE):
            continue
        _shard_experts(layer.experts, ep_mesh)
        layer.exchange = AllToAll(ep_mesh.get_group(), ep, layer.num_experts)
        names += [f"{layer_name}.experts.{n}" for n in ("gate", "up", "down")]
    return EPState(mesh, dp, names)


class EPState:
    """The experts' mesh, and the gradient sync the step calls after backward."""

    def __init__(self, mesh: Any, dp: int, param_names: list[str]):
        self.mesh, self.dp, self.param_names = mesh, dp, param_names

    def params(self, model: nn.Module) -> set[nn.Parameter]:
        """The routed experts' parameters (what DDP or FSDP must leave alone)."""
        return {
            p
            for layer in moe_layers(model)
            for p in (layer.experts.gate, layer.experts.up, layer.experts.down)
        }

    def sync_grads(self, model: nn.Module) -> None:
        """Each expert's gradient: summed over the ranks holding the same experts
        (edp) and divided by dp (the mean over the step's tokens, as DDP's
        average gives the replicated experts)."""
        edp = self.mesh["edp"]
        for layer in moe_layers(model):
            for p in (layer.experts.gate, layer.experts.up, layer.experts.down):
                if p.grad is None:
                    continue
                g = p.grad.to_local()
                if edp.size() > 1:
                    dist.all_reduce(g, group=edp.get_group())
                g.div_(self.dp)
