"""The routed experts of an MoE layer: `num_experts` SwiGLU MLPs held as three
stacked weights ([E, f, h] gate and up, [E, h, f] down: each expert's slice is
its nn.Linear weight, out x in) and run as ONE grouped matrix multiply over
rows sorted by expert, never a Python loop over experts.

Three kernels, the same arithmetic:
- `torch._grouped_mm` with its own autograd (CUDA, bf16: a grouped GEMM over the
  row offsets of each expert, no host read);
- on CPU in fp32, the CPU's `torch._grouped_mm` in a small autograd Function
  (`_GroupedMM`: torch 2.13's CPU kernel runs forward but not backward, so the
  backward is written as two more grouped GEMMs); no padding;
- elsewhere (and with `use_grouped_mm = False`) a padded batched matmul: the rows
  are placed in an [E, C, h] block (C: the most rows any expert got, one host
  read; empty slots are zeros), three `torch.bmm`s run every expert at once, and
  the rows are gathered back. It pays for the padding: max/mean load x the FLOPs.

`looped_forward` is the per-expert loop they replace: the reference of the
tests (tests/unit/models/test_moe.py) and of the benchmark (devtools/bench).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the matmuls of `x` run in: autocast's when it is on, else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def grouped_mm_available(x: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` runs these rows with its own backward: CUDA, bf16."""
    return x.is_cuda and compute_dtype(x) == torch.bfloat16 and hasattr(torch, "_grouped_mm")


def cpu_grouped_mm_available(x: torch.Tensor, width: int) -> bool:
    """Whether the CPU's `torch._grouped_mm` runs these rows (through `_GroupedMM`:
    its forward works in torch 2.13, its autograd does not): fp32, and rows of a
    multiple of 16 bytes (the kernel's stride rule; model.moe's widths are
    multiples of 8)."""
    return (
        x.device.type == "cpu"
        and compute_dtype(x) == torch.float32
        and hasattr(torch, "_grouped_mm")
        and x.shape[1] % 4 == 0
        and width % 4 == 0
    )


class _GroupedMM(torch.autograd.Function):
    """y = x @ w[e].T for the rows of each group e (offsets `offs`), with the
    backward as two more grouped GEMMs: dx = dy @ w[e], dw[e] = dy_e.T @ x_e."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w, offs)
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        x, w, offs = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch._grouped_mm(dy, w, offs=offs)
        pad = -x.shape[0] % 4  # dy.T's rows must be 16-byte multiples: zero rows, no group's
        dy_t = F.pad(dy, (0, 0, 0, pad)).t().contiguous()
        dw = torch._grouped_mm(dy_t, F.pad(x, (0, 0, 0, pad)), offs=offs)
        return dx, dw, None


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, width: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate = nn.Parameter(torch.empty(num_experts, width, hidden))
        self.up = nn.Parameter(torch.empty(num_experts, width, hidden))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, width))
        # None: choose by the device and dtype (grouped_mm_available,
        # cpu_grouped_mm_available); False forces the padded batched matmul.
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
        width = self.gate.shape[1]
        if self.use_grouped_mm is None and cpu_grouped_mm_available(x, width):
            return self._cpu_grouped(x, counts)
        return self._padded(x, counts)

    def _cpu_grouped(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offs = counts.cumsum(0).to(torch.int32)
        gate, up, down = self.weights()
        h = F.silu(_GroupedMM.apply(x, gate, offs)) * _GroupedMM.apply(x, up, offs)
        return _GroupedMM.apply(h, down, offs)

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
