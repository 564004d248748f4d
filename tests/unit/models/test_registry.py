"""The architecture registry: names, errors, one-file architectures, torch-free planning."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

import trainlab.models
from tests.unit.models.common import small
from trainlab.errors import UserError
from trainlab.models import archs as archs_pkg
from trainlab.models import registry
from trainlab.models.registry import Architecture, arch_names, build_model, get_arch
from trainlab.plan import count_params

REPO = Path(__file__).resolve().parents[3]


def test_registry_lists_every_architecture():
    assert arch_names() == sorted(arch_names())
    assert {"gpt2", "llama", "llama_qknorm"} <= set(arch_names())
    for name in arch_names():
        arch = get_arch(name)
        assert isinstance(arch, Architecture) and arch.name == name and arch.summary


def test_unknown_architecture_is_a_user_error_naming_the_choices():
    with pytest.raises(
        UserError,
        match=r"model.arch = 'gpt3': unknown architecture; "
        r"available: gpt2, llama, llama_qknorm",
    ):
        get_arch("gpt3")
    with pytest.raises(ValidationError, match=r"unknown architecture; available: gpt2, llama"):
        small("gpt3")


def test_building_is_driven_only_by_the_name():
    """Same config but the name: each build is its registered architecture's."""
    seen = set()
    for name in arch_names():
        model = build_model(small(name))
        seen.add(tuple(model.state_dict()))
        assert registry.num_parameters(model) == count_params(model.cfg).total
    assert len(seen) == len(arch_names())


def test_defaults_come_from_the_architecture():
    assert small("gpt2").ffn_hidden_size == 4 * 32
    assert small("llama", hidden_size=4096, num_heads=32).ffn_hidden_size == 11008
    assert small("llama_qknorm", hidden_size=4096, num_heads=32).ffn_hidden_size == 11008


def test_a_new_architecture_is_one_file(tmp_path, monkeypatch):
    """Dropping a module with @register_arch into trainlab/models/archs is all it
    takes: the config validates it, the planner counts it, build_model builds it."""
    (tmp_path / "tiny_gelu_llama.py").write_text(
        "from trainlab.models.archs.llama import Llama\n"
        "from trainlab.models.registry import ParamCount, register_arch\n\n"
        "@register_arch('tiny_gelu_llama')\n"
        "class TinyGeluLlama(Llama):\n"
        "    summary = 'llama blocks with a bias-free GELU MLP'\n"
        "    mlp_activation_factor = 4.0\n\n"
        "    def default_ffn_hidden_size(self, m):\n"
        "        return 2 * m.hidden_size\n\n"
        "    def count_params(self, m):\n"
        "        h, f = m.hidden_size, m.ffn_hidden_size\n"
        "        per_layer = self.attention_params(m) + 2 * h * f + 2 * h\n"
        "        return ParamCount.of(m, per_layer=per_layer, final_norm=h)\n\n"
        "    def build(self, m):\n"
        "        from trainlab.models.layers import (\n"
        "            Attention, Block, GeluMLP, RMSNorm, TransformerLM)\n"
        "        norm = lambda d: RMSNorm(d, m.norm_eps)\n"
        "        block = lambda: Block(norm(m.hidden_size), Attention(m, bias=False),\n"
        "                              norm(m.hidden_size), GeluMLP(m, bias=False), m.dropout)\n"
        "        return TransformerLM(m, block=block, norm=norm, positions='rope')\n"
    )
    monkeypatch.setattr(archs_pkg, "__path__", [*archs_pkg.__path__, str(tmp_path)])
    monkeypatch.setattr(registry, "_discovered", False)
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.delitem(sys.modules, "trainlab.models.archs.tiny_gelu_llama", raising=False)
    assert "tiny_gelu_llama" in arch_names()
    cfg = small("tiny_gelu_llama")
    assert cfg.ffn_hidden_size == 64
    model = build_model(cfg)
    assert registry.num_parameters(model) == count_params(cfg).total
    assert model(model.tok_embeddings.weight.new_zeros(1, 8).long()).shape == (1, 8, 97)


def test_registering_one_name_twice_is_refused(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    class Impostor(Architecture):
        pass

    with pytest.raises(ValueError, match="'llama' is registered twice"):
        registry.register_arch("llama")(Impostor)


def test_the_models_package_keeps_its_public_names():
    for name in (
        "build_model",
        "num_parameters",
        "segment_positions",
        "get_attention",
        "available",
        "register",
        "AttentionMask",
        "TransformerLM",
    ):
        assert getattr(trainlab.models, name) is not None, name
    assert "sdpa" in trainlab.models.available()
    with pytest.raises(AttributeError):
        trainlab.models.no_such_name  # noqa: B018
    from trainlab.models.layers import Block, TransformerLM

    assert build_model(small("gpt2")).layers[0].__class__ is Block
    assert isinstance(build_model(small("llama")), TransformerLM)


def test_validate_and_plan_every_architecture_without_torch():
    """Registry, every arch file, config validation and the planner stay torch-free
    (trainlab validate/show/plan must not pay for importing torch)."""
    code = (
        "import sys\n"
        "import trainlab.models\n"
        "from trainlab.config import ExperimentConfig\n"
        "from trainlab.models.registry import arch_names, get_arch\n"
        "from trainlab.plan import plan\n"
        "assert trainlab.models.build_model is not None\n"
        "for name in arch_names():\n"
        "    cfg = ExperimentConfig.model_validate({'name': 't', 'data': {'seq_len': 64},\n"
        "        'model': {'arch': name, 'hidden_size': 64, 'num_heads': 4, 'num_layers': 2,\n"
        "                  'vocab_size': 128, 'max_seq_len': 64}})\n"
        "    p = plan(cfg)\n"
        "    assert p.num_params == get_arch(name).count_params(cfg.model).total > 0\n"
        "    print('PLANNED', name)\n"
        "print('TORCH', 'torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert [ln.split()[1] for ln in lines[:-1]] == arch_names()
    assert lines[-1] == "TORCH False"
