"""The measured path (trainlab.models.measured) held against the built-in
families' formulas: a built-in family built and measured like a user
architecture gives its parameters exactly, its FLOPs within 1% and its
activation term (what autograd saves per block and token) as stated below."""

from __future__ import annotations

import pytest

from trainlab.config.loader import validate_raw
from trainlab.models.measured import MeasuredArchitecture, repeated_blocks
from trainlab.models.registry import get_arch
from trainlab.plan.memory import step_dtypes
from trainlab.plan.model_math import flops_per_token

SEQ = 128


class AsMeasured(MeasuredArchitecture):
    """A built-in family known only by its build, as a user's would be."""

    def __init__(self, inner):
        self.inner, self.name = inner, f"measured-{inner.name}"

    def build_module(self, m):
        return self.inner.build(m)


def section(arch: str):
    kv = None if arch == "gpt2" else 2
    model = {"arch": arch, "hidden_size": 128, "num_layers": 2, "num_heads": 4,
             "num_kv_heads": kv, "ffn_hidden_size": 384, "vocab_size": 1024, "max_seq_len": 256}
    return validate_raw({"name": "m", "model": model, "data": {"seq_len": SEQ}}).model


@pytest.mark.parametrize("arch", ["llama", "llama_qknorm", "gpt2"])
def test_measured_parameters_are_the_formulas(arch):
    m = section(arch)
    builtin = get_arch(arch)
    measured = AsMeasured(builtin)
    assert measured.count_params(m).total == builtin.count_params(m).total
    as_set = lambda shapes: {(p.name, p.shape, p.layer, p.matmul) for p in shapes}  # noqa: E731
    assert as_set(measured.param_shapes(m)) == as_set(builtin.param_shapes(m))


@pytest.mark.parametrize("arch", ["llama", "llama_qknorm", "gpt2"])
def test_measured_flops_agree_with_the_palm_formula(arch):
    """FlopCounterMode's matmuls and attention vs 6N + 12 L H Q T: measured
    0.999 (llama, llama_qknorm) and 0.994 (gpt2: its learned-position table is no
    matmul, the formula's N counts the output projection once)."""
    m = section(arch)
    ratio = AsMeasured(get_arch(arch)).flops_per_token(m, SEQ) / flops_per_token(m, SEQ)
    assert ratio == pytest.approx(1.0, abs=0.01)


# measured / formula, per step dtypes (precision, fsdp): fp32 and FSDP bf16 agree to
# within 8%; under autocast (DDP bf16) the measurement on fake CPU tensors sees fewer
# 16-bit copies than the formula (which the trace of the real step confirms) and
# reads 0.63-0.76 of it: the planner's estimate for such a run of a measured
# architecture is low by that part of its activations (docs/models.md).
AGREEMENT = {("fp32", False): (0.93, 1.01), ("bf16", True): (0.92, 1.01),
             ("bf16", False): (0.6, 0.8)}


@pytest.mark.parametrize("arch", ["llama", "llama_qknorm", "gpt2"])
@pytest.mark.parametrize("dtypes", list(AGREEMENT), ids=lambda d: f"{d[0]}-{'fsdp' if d[1] else 'ddp'}")
def test_measured_activation_term_against_the_formula(arch, dtypes):
    m = section(arch)
    builtin = get_arch(arch)
    d = step_dtypes(dtypes[0], dtypes[1], False)
    ratio = AsMeasured(builtin).block_saved_bytes(m, d, SEQ) / builtin.block_saved_bytes(m, d, SEQ)
    low, high = AGREEMENT[dtypes]
    assert low <= ratio <= high, ratio


def test_repeated_blocks_are_found_without_a_layers_attribute():
    import torch
    from torch import nn

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.ModuleList([nn.Linear(4, 4)])
            self.trunk = nn.ModuleList(nn.Sequential(nn.Linear(4, 4)) for _ in range(3))

        def forward(self, x):
            return x

    model = Odd()
    assert repeated_blocks(model) == list(model.trunk)
    model._no_split_modules = ["Linear"]
    assert len(repeated_blocks(model)) == 4
    assert torch.is_tensor(model(torch.zeros(1)))
