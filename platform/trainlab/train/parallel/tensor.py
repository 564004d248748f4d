"""Tensor parallelism (Megatron-style, on DTensor) for the models of
trainlab.models.layers, applied from outside by module name.

Per block: q, k, v and the MLP's input projections column-wise (each rank holds
num_heads/tp query and num_kv_heads/tp key/value heads, so grouped-query
attention stays grouped on every rank), attention's `out` and the MLP's `proj`
row-wise (one all-reduce each in forward, one in backward). The token
embedding is vocabulary-parallel (rows of the table), and the output projection
column-wise over the vocabulary with its logits left sharded: the loss is
computed by `loss_parallel` (trainlab.train.loop.step) without gathering the logits.
With tied embeddings both hold the same Shard(0) table, which stays tied.

Sequence parallelism (`parallel.sequence_parallel`): the residual stream
between blocks, the norms and dropout are sharded over the sequence, so the
activations outside attention and the MLP are 1/tp per rank; the all-reduces
become all-gather / reduce-scatter pairs.

Parameters not touched above (norms, learned positions) stay ordinary
replicated tensors without sequence parallelism: their gradients are the same
on every rank of the group, because the column-wise layers' input gradients
are all-reduced before they reach them.

An MoE block's MLP (trainlab.models.moe.layer.MoE: router, routed and shared
experts) is not sharded either: it stays replicated over the tp group, like the
norms. Every tp rank holds the same residual stream, routes the same tokens and
computes the same output, so it needs no collective and its gradients are the
same on every rank (expert parallelism, if any, splits the routed experts over
data-parallel ranks: trainlab.train.parallel.expert). Not under sequence
parallelism (the config rules refuse it): the MoE would see a sequence shard.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from trainlab.models.moe.layer import MoE


def apply_plan(model: nn.Module, tp_mesh: Any, plan: dict[str, str]) -> None:
    """Shard `model` over `tp_mesh` in place by an architecture's own plan
    ({module path pattern: "colwise" | "rowwise"}, e.g. transformers'
    `base_model_tp_plan`): local outputs, so the model's code runs on its share
    of the heads and of the MLP width unchanged; everything the plan does not
    name stays replicated."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, tp_mesh, {path: styles[s]() for path, s in plan.items()})


def _mlp_plan(mlp: nn.Module, colwise: Any, rowwise: Any) -> dict[str, Any]:
    names = [n for n in ("gate", "up", "fc") if hasattr(mlp, n)]
    return {**{f"mlp.{n}": colwise() for n in names}, "mlp.proj": rowwise}


def apply_tensor_parallel(model: nn.Module, tp_mesh: Any, sequence_parallel: bool) -> None:
    """Shard `model` (a TransformerLM or a pipeline stage of one) over `tp_mesh`
    in place."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    sp = sequence_parallel
    residual = Shard(1) if sp else Replicate()
    top: dict[str, Any] = {}
    if getattr(model, "tok_embeddings", None) is not None:
        top["tok_embeddings"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=residual, use_local_output=not sp
        )
        if sp and getattr(model, "pos_embeddings", None) is not None:
            raise ValueError("sequence parallelism with learned positions is not supported")
    if getattr(model, "output", None) is not None:
        top["output"] = ColwiseParallel(
            input_layouts=residual, output_layouts=Shard(-1), use_local_output=False
        )
        if sp:
            top["norm"] = SequenceParallel()
    if top:
        parallelize_module(model, tp_mesh, top)

    layers = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    for block in layers:
        moe = isinstance(block.mlp, MoE)  # replicated over tp (module docstring)
        if moe and sp:
            raise ValueError("sequence parallelism with MoE layers is not supported")
        plan: dict[str, Any] = {
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            "attn.out": RowwiseParallel(output_layouts=residual, use_local_output=not sp),
        }
        if not moe:
            plan.update(
                _mlp_plan(
                    block.mlp,
                    ColwiseParallel,
                    RowwiseParallel(output_layouts=residual, use_local_output=not sp),
                )
            )
        if sp:
            plan.update(
                {
                    "attn_norm": SequenceParallel(),
                    "mlp_norm": SequenceParallel(),
                    # attention's input: gathered over the sequence; mask and RoPE as given
                    "attn": PrepareModuleInput(
                        input_layouts=(Shard(1), None, None),
                        desired_input_layouts=(Replicate(), None, None),
                    ),
                    "mlp": PrepareModuleInput(
                        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                    ),
                }
            )
        parallelize_module(block, tp_mesh, plan)

    # parallelize_module gives each sharded Linear/Embedding a new Parameter: re-tie.
    tok, out = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    if tok is not None and out is not None and model.cfg.tie_embeddings:
        out.weight = tok.weight
