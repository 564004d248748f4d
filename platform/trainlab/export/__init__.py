"""Leaving trainlab: a checkpoint as a Hugging Face model directory.

`export_model(path, out)` turns the newest valid checkpoint of a run (or one
checkpoint, or `step`) into what `transformers.AutoModelForCausalLM` and
`AutoTokenizer.from_pretrained(out)` load: `config.json` for the matching
transformers class, safetensors weights (sharded past a size, with their
index), `generation_config.json`, the dataset's tokenizer as a
`PreTrainedTokenizerFast`, and `export.json` (what was exported, from where,
every file's sha256). It is logged to the run's MLflow record.

Parts: `source` (finding the checkpoint and reading its model tensors one at a
time, from either checkpoint format), `hf` (the mapping to transformers
classes, and the refusals), `safetensors_out` (streaming writer), `tokenizer`,
`record` (MLflow), `exporter` (the whole export). No part imports
transformers: the files are written directly, so exporting needs neither it
nor a GPU nor the training layout. See docs/export.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainlab.export.exporter import export_model

__all__ = ["export_model"]


def __getattr__(name: str) -> Any:
    if name == "export_model":
        from trainlab.export.exporter import export_model

        return export_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
