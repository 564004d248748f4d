"""The routed experts of an MoE layer: `num_experts` SwiGLU MLPs held as three
stacked weights ([E, f, h] gate and up, [E, h, f] down: each expert's slice is
its nn.Linear weight, out x in) and run as ONE grouped matrix multiply over
rows sorted by expert, never a Python loop over experts.

Two kernels, the same arithmetic:
- `torch._grouped_mm` (CUDA, 16-bit: a grouped GEMM over the row offsets of each
  expert, no host read);
- elsewhere a padded batched matmul: the rows are placed in an [E, C, h] block
  (C: the most rows any expert got, one host read; empty slots are zeros), three
  `torch.bmm`s run every expert at once, and the rows are gathered back.

`looped_forward` is the per-expert loop they replace: the reference of the
tests (tests/unit/models/test_moe.py) and of the benchmark (devtools/bench).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the matmuls of `x` run in: autocast's when it is on, else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def grouped_mm_available(x: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` runs these rows: CUDA and bf16 (its kernels;
    CPU's has no working backward in torch 2.13)."""
    return x.is_cuda and compute_dtype(x) == torch.bfloat16 and hasattr(torch, "_grouped_mm")


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, width: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate = nn.Parameter(torch.empty(num_experts, width, hidden))
        self.up = nn.Parameter(torch.empty(num_experts, width, hidden))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, width))
        # None: choose by the device (grouped_mm_available); False forces the padded
        # batched matmul (tests compare the two on CUDA).
        self.use_grouped_mm: bool | None = None

    def init_weights(self, std: float, residual_std: float) -> None:
        """GPT-2 init as the dense MLP's: N(0, std), the output projection residual-scaled."""
        nn.init.normal_(self.gate, std=std)
        nn.init.normal_(self.up, std=std)
        nn.init.normal_(self.down, std=residual_std)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate, up, down) as this rank holds them: under expert parallelism the
        parameters are DTensors of all experts and the local block is used."""
        return tuple(
            w.to_local() if hasattr(w, "to_local") else w for w in (self.gate, self.up, self.down)
        )  # type: ignore[return-value]

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`x` [M, h]: rows sorted by expert, `counts[e]` of them for expert e of
        the experts this module holds (sum(counts) == M). Returns [M, h]."""
        grouped = self.use_grouped_mm
        if grouped is None:
            grouped = grouped_mm_available(x)
        if grouped:
            return self._grouped(x.to(compute_dtype(x)), counts)
        return self._padded(x, counts)

    def _grouped(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offs = counts.cumsum(0).to(torch.int32)
        gate, up, down = (w.to(x.dtype) for w in self.weights())
        g = torch._grouped_mm(x, gate.transpose(-2, -1), offs=offs)
        u = torch._grouped_mm(x, up.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(F.silu(g) * u, down.transpose(-2, -1), offs=offs)

    def _padded(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.weights()
        m, e = x.shape[0], gate.shape[0]
        starts = counts.cumsum(0) - counts
        expert_of_row = torch.repeat_interleave(
            torch.arange(e, device=x.device), counts, output_size=m
        )
        slot = torch.arange(m, device=x.device) - starts[expert_of_row]
        capacity = int(counts.max()) if m else 0  # the one host read of this path
        block = x.new_zeros(e, capacity, x.shape[1])
        block = block.index_put((expert_of_row, slot), x)
        g = torch.bmm(block, gate.transpose(1, 2))
        u = torch.bmm(block, up.transpose(1, 2))
        y = torch.bmm(F.silu(g) * u, down.transpose(1, 2))
        return y[expert_of_row, slot]

    def looped_forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The per-expert loop (reference and benchmark baseline, not the model's path)."""
        gate, up, down = self.weights()
        out = []
        for e, rows in enumerate(x.split(counts.tolist())):
            h = F.silu(rows @ gate[e].T) * (rows @ up[e].T)
            out.append(h @ down[e].T)
        return torch.cat(out) if out else x.new_zeros(0, x.shape[1])
