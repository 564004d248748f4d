"""Pipeline parallelism with `torch.distributed.pipelining`.

The model is cut into `pp * v` stages (v = parallel.pp_virtual_stages, more
than one only for interleaved schedules); stage s runs on pipeline rank
s mod pp ("loop" placement, as the interleaved schedules expect). The cut
balances units of work where the token embedding and the output head (norm +
vocabulary projection) count as one unit each beside the L blocks: stage s
gets units [round(s U / S), round((s + 1) U / S)) of U = L + 2. A stage is the
model itself with the parts other stages own set to None and its blocks in a
ModuleDict keyed by their original index, so every parameter keeps the name it
has in the whole model (checkpoints reshard between layouts by those names).

Tied embeddings with the embedding and the head on different ranks: the last
stage holds a copy of the table as `output.weight`, made from the same seeded
weights; after backward the two copies' gradients are summed across the two
ranks (`PipelinePlan.sync_tied_gradients`), so they get the same update and
stay equal; the copy is left out of the gradient norm and saved under the
table's name (trainlab.train.loop.state).

Schedules by name (parallel.pp_schedule): gpipe, 1f1b, interleaved_1f1b. The
rank's rows of a step are split into parallel.pp_microbatches micro batches.
Losses are summed token cross-entropies scaled by 1 / (the rank's labelled
tokens), so gradients need no further scaling (scale_grads=False) and equal
those of the unsplit model on the same rows.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainlab.data import IGNORE_INDEX
from trainlab.models.loss import chunked_cross_entropy

SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
}
MULTI_STAGE = {"interleaved_1f1b"}


def stage_units(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """[start, stop) units of each stage; unit 0 is the embedding, units 1..L the
    blocks, unit L + 1 the head."""
    units = num_layers + 2
    if not 1 <= num_stages <= units:
        raise ValueError(f"{num_stages} pipeline stages for {units} units (blocks + 2)")
    bounds = [round(s * units / num_stages) for s in range(num_stages + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def stages_of_rank(pp_rank: int, pp: int, virtual: int) -> list[int]:
    return [pp_rank + k * pp for k in range(virtual)]


def cut_stage(model: nn.Module, start: int, stop: int) -> nn.Module:
    """A copy of `model` keeping units [start, stop) (see stage_units)."""
    stage = copy.deepcopy(model)
    n = len(model.layers)
    keep = [i for i in range(n) if start <= i + 1 < stop]
    stage.layers = nn.ModuleDict({str(i): stage.layers[i] for i in keep})
    if start > 0:
        stage.tok_embeddings = None
        stage.pos_embeddings = None
    if stop <= n + 1:
        stage.norm = None
        stage.output = None
    return stage


def is_tied_copy(stage: nn.Module) -> bool:
    """A last stage holding its own copy of a tied embedding table."""
    return (
        stage.cfg.tie_embeddings
        and getattr(stage, "output", None) is not None
        and getattr(stage, "tok_embeddings", None) is None
    )


@dataclass
class PipelinePlan:
    """This rank's stages, their schedule, and how the step drives it."""

    stages: list[nn.Module]
    stage_ids: list[int]
    num_stages: int
    schedule_name: str
    microbatches: int
    pp_rank: int
    pp: int
    group: Any  # the pp process group
    tied_group: Any = None  # the first and last stage's ranks, when the table is tied
    schedule: Any = None
    loss_scale: float | torch.Tensor = 1.0
    loss_chunk: int = 0

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def build_schedule(self, device: torch.device) -> None:
        from torch.distributed import pipelining

        pipe_stages = [
            pipelining.PipelineStage(stage, sid, self.num_stages, device, group=self.group)
            for stage, sid in zip(self.stages, self.stage_ids, strict=True)
        ]
        cls = getattr(pipelining, SCHEDULES[self.schedule_name])
        first = pipe_stages if self.schedule_name in MULTI_STAGE else pipe_stages[0]
        self.schedule = cls(first, self.microbatches, loss_fn=self._loss, scale_grads=False)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if hasattr(logits, "placements"):  # tensor parallelism: loss_parallel's
            loss = F.cross_entropy(
                logits.float().flatten(0, 1),
                labels.flatten(),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
        else:  # chunk by chunk in fp32 (trainlab.models.loss)
            loss = chunked_cross_entropy(logits, labels, self.loss_chunk)
        return loss * self.loss_scale

    def run(
        self,
        batch: dict[str, torch.Tensor],
        scale: float | torch.Tensor,
        backward: bool,
        chunk: int = 0,
    ) -> torch.Tensor | None:
        """One pass of the schedule over the rank's rows `batch` (all micro batches):
        forward and backward when `backward`, else forward only. Returns the sum of
        the micro batches' scaled losses on the rank holding the last stage, else None.
        `scale` may be a device tensor (the step reads nothing back); `chunk` is
        train.loss_chunk_tokens."""
        self.loss_scale, self.loss_chunk = scale, chunk
        kwargs = {k: batch[k] for k in ("position_ids", "document_ids") if k in batch}
        args = (batch["input_ids"],) if self.has_first else ()
        target = batch["labels"] if self.has_last else None
        losses: list[torch.Tensor] | None = [] if self.has_last else None
        run = self.schedule.step if backward else self.schedule.eval
        run(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        if not losses:
            return None
        total = sum(
            (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach()
            for loss in losses
        )
        return total

    def sync_tied_gradients(self) -> None:
        """Sum the gradients of the two copies of a tied embedding table."""
        if self.tied_group is None:
            return
        import torch.distributed as dist

        for stage in self.stages:
            weight = None
            if getattr(stage, "tok_embeddings", None) is not None and stage.output is None:
                weight = stage.tok_embeddings.weight
            elif is_tied_copy(stage):
                weight = stage.output.weight
            if weight is not None and weight.grad is not None:
                grad = weight.grad
                placements = getattr(weight, "placements", None)
                if placements is not None and grad.placements != placements:
                    # e.g. an embedding's gradient comes back replicated over tp
                    grad = weight.grad = grad.redistribute(placements=placements)
                local = grad.to_local() if hasattr(grad, "to_local") else grad
                dist.all_reduce(local, group=self.tied_group)


def split_model(
    model: nn.Module, pp_rank: int, pp: int, virtual: int
) -> tuple[list[nn.Module], list[int], int]:
    """This rank's stages of `model`, their stage ids, and the number of stages."""
    num_stages = pp * virtual
    units = stage_units(len(model.layers), num_stages)
    ids = stages_of_rank(pp_rank, pp, virtual)
    return [cut_stage(model, *units[s]) for s in ids], ids, num_stages


def tied_groups(layout: Any, tie: bool, num_stages: int) -> Callable[[int], Any]:
    """Build (on every rank, in the same order) the process groups joining the rank
    of the first stage and the rank of the last stage for each (dp, tp) pair;
    returns rank -> its group (None where it has neither)."""
    import torch.distributed as dist

    pp = layout.pp
    last_rank = (num_stages - 1) % pp
    groups: dict[int, Any] = {}
    if tie and last_rank != 0:
        for d in range(layout.dp):
            for t in range(layout.tp):
                ranks = [layout.rank_of(0, d, t), layout.rank_of(last_rank, d, t)]
                group = dist.new_group(ranks)
                for r in ranks:
                    groups[r] = group
    return groups.get
