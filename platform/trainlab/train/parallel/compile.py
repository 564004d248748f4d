"""Compiled blocks (`train.compile`): `torch.compile` of each transformer block,
applied after recomputation and before FSDP (torchtitan's order), so a block's
checkpointing is compiled with it and FSDP's hooks stay outside the graph.

Per block rather than the whole model: every block has the same code and
shapes, so one compilation serves them all (the others reuse the cached graph),
and the model's parts around them (embeddings, the loss) stay eager.
`Module.compile()` compiles in place: parameter names, state dicts and
checkpoints are those of the eager model.

`auto` is on for CUDA only: on CPU compiling takes tens of seconds (about 35 s
for the tiny recipe on 2 shared cores) and the step runs no faster (docs/gpu.md).
The compile time is reported once per run (`compile_seconds`, the trainer's
`compile_time_s` metric and log line).
"""

from __future__ import annotations

from torch import nn

from trainlab.train.parallel.blocks import blocks


def enabled(setting: str, device_type: str) -> bool:
    """Whether `train.compile = setting` compiles on a device of this type."""
    return setting == "true" or (setting == "auto" and device_type == "cuda")


def apply(model: nn.Module) -> int:
    """Compile each block of `model` (a model or a pipeline stage) in place;
    returns how many."""
    parts = blocks(model)
    for block in parts:
        block.compile()
    return len(parts)


def compile_seconds() -> float:
    """Seconds torch has spent compiling in this process so far: dynamo's frames
    (with AOTAutograd and Inductor's forward inside) and the backward graphs
    Inductor compiles at their first use."""
    from torch._dynamo.utils import compilation_time_metrics as metrics

    frames = sum(metrics.get("_compile.compile_inner", []))
    backward = sum(sum(times) for name, times in metrics.items() if name.endswith("bw_compiler"))
    return frames + backward
