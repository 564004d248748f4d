"""The planner asks the architecture (trainlab.models.archs) for what depends on it."""

from __future__ import annotations

import pytest

from trainlab.config import ModelConfig
from trainlab.models.registry import ParamCount, arch_names, get_arch
from trainlab.plan import ParamCount as PlanParamCount
from trainlab.plan import activation_bytes_per_layer, count_params


@pytest.mark.parametrize("arch", arch_names())
def test_count_params_is_the_architectures(arch):
    m = ModelConfig(arch=arch, hidden_size=256, num_layers=3, num_heads=4, vocab_size=1000)
    assert count_params(m) == get_arch(arch).count_params(m)
    assert PlanParamCount is ParamCount


def test_qknorm_activation_terms_add_the_norm_inputs():
    kw = dict(
        hidden_size=1024,
        num_layers=1,
        num_heads=16,
        num_kv_heads=4,
        ffn_hidden_size=2048,
        vocab_size=1000,
    )
    s, b, g = 512, 2, 0.25
    llama = activation_bytes_per_layer(ModelConfig(arch="llama", **kw), s, b, recompute="selective")
    qk = activation_bytes_per_layer(
        ModelConfig(arch="llama_qknorm", **kw), s, b, recompute="selective"
    )
    assert qk - llama == pytest.approx(s * b * 1024 * (2 + 2 * g))
