"""Writing safetensors files one tensor at a time.

The format (safetensors' own spec): an 8-byte little-endian header length, a
JSON header mapping each tensor name to its dtype, shape and byte range
(`data_offsets`, relative to the end of the header) plus `__metadata__`, then
the raw little-endian bytes. Knowing every shape and dtype up front, the
header is written first and each tensor streamed after it, so memory holds
one tensor at a time instead of a whole shard. Past `max_shard_bytes` the
tensors go to `model-0000i-of-0000n.safetensors` files listed in
`model.safetensors.index.json`, as transformers writes them.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def shard(entries: Sequence[Entry], max_shard_bytes: int) -> list[list[Entry]]:
    """Entries in order, grouped into files of at most `max_shard_bytes` each (a
    tensor larger than that gets a file of its own)."""
    groups: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if groups[-1] and size + e.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += e.nbytes
    return groups


def file_names(n: int) -> list[str]:
    if n == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def _header(entries: Sequence[Entry]) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        header[e.name] = {
            "dtype": ST_DTYPES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # pad so the data starts 8-byte aligned


def write_file(path: Path, entries: Sequence[Entry], tensor: Callable[[Entry], torch.Tensor]) -> None:
    """Write `entries` to one safetensors file, fetching each with `tensor(entry)`."""
    header = _header(entries)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for e in entries:
            t = tensor(e)
            if tuple(t.shape) != e.shape or t.dtype != e.dtype:
                raise RuntimeError(
                    f"{e.name}: built {tuple(t.shape)} {t.dtype}, planned {e.shape} {e.dtype}"
                )
            data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            f.write(memoryview(data))


def write_all(
    out: Path,
    entries: Sequence[Entry],
    tensor: Callable[[Entry], torch.Tensor],
    max_shard_bytes: int,
) -> list[str]:
    """Write the weights into `out` (one file, or shards and their index);
    returns the file names written."""
    groups = shard(entries, max_shard_bytes)
    names = file_names(len(groups))
    for name, group in zip(names, groups, strict=True):
        write_file(out / name, group, tensor)
    if len(names) == 1:
        return names
    index = {
        "metadata": {"total_size": sum(e.nbytes for e in entries)},
        "weight_map": {e.name: name for name, group in zip(names, groups, strict=True)
                       for e in group},
    }
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [*names, INDEX_FILE]
