"""The config layer: inheritance, overrides, every cross-field rule, the error format."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from tests.conftest import RECIPES
from trainlab.config import ExperimentConfig, config_hash, flatten, load_config, to_yaml
from trainlab.errors import ConfigError


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def problems(path: Path, *overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    return e.value.lines


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return write(
        tmp_path / "base.yaml",
        """
        name: base
        model: {arch: llama, hidden_size: 64, num_layers: 4, num_heads: 4, vocab_size: 512}
        data: {seq_len: 64, micro_batch_size: 2, mix: {a: 1.0, b: 3.0}}
        train: {lr: 1.0e-3, warmup_steps: 5, total_steps: 50}
        parallel: {strategy: ddp}
        resource: {num_workers: 2}
    """,
    )


# --------------------------------------------------------------------------- recipes


@pytest.mark.parametrize("recipe", sorted(p.name for p in RECIPES.glob("*.yaml")))
def test_every_recipe_validates_and_round_trips(recipe: str, tmp_path: Path):
    cfg = load_config(RECIPES / recipe)
    assert cfg.purpose and cfg.expectation, "every recipe states its purpose and expectation"
    # `show` output is itself a valid config that resolves to the same thing.
    again = write(tmp_path / "resolved.yaml", to_yaml(cfg))
    assert load_config(again) == cfg


def test_recipe_family_defaults(tmp_path: Path, base: Path):
    child = write(tmp_path / "exp" / "lr_sweep.yaml", "extends: ../base.yaml\n")
    cfg = load_config(child)
    assert cfg.name == "lr_sweep"  # not inherited: defaults to the file's stem
    assert cfg.tracking.experiment == "lr_sweep"  # the recipe family
    cfg = load_config(child, ["name=lr_sweep_3e-4"])
    assert cfg.name == "lr_sweep_3e-4" and cfg.tracking.experiment == "lr_sweep"


# --------------------------------------------------------------------------- inheritance


def test_extends_chain_merges_key_by_key(tmp_path: Path, base: Path):
    write(
        tmp_path / "mid.yaml",
        """
        extends: base.yaml
        model: {num_layers: 8}
        data: {mix: {b: 1.0, c: 2.0}}
    """,
    )
    leaf = write(
        tmp_path / "sub" / "leaf.yaml",
        """
        extends: ../mid.yaml
        name: leaf
        train: {lr: 2.0e-3}
    """,
    )
    cfg = load_config(leaf)
    assert cfg.name == "leaf"
    assert cfg.model.num_layers == 8 and cfg.model.hidden_size == 64  # merged, not replaced
    assert cfg.train.lr == 2e-3 and cfg.train.total_steps == 50
    assert cfg.data.mix == {"a": 1.0, "b": 1.0, "c": 2.0}


def test_record_fields_are_not_inherited(tmp_path: Path):
    write(tmp_path / "base.yaml", "name: b\npurpose: p\nexpectation: e\nowner: o\n")
    leaf = load_config(write(tmp_path / "leaf.yaml", "extends: base.yaml\n"))
    assert (leaf.name, leaf.purpose, leaf.expectation, leaf.owner) == ("leaf", "", "", "o")


def test_null_removes_a_key_back_to_its_default(tmp_path: Path, base: Path):
    leaf = write(tmp_path / "leaf.yaml", "extends: base.yaml\ndata: {mix: {a: null}}\n")
    assert load_config(leaf).data.mix == {"b": 3.0}
    assert load_config(base, ["model.ffn_hidden_size=null"]).model.ffn_hidden_size == 256


def test_extends_cycle_is_an_error(tmp_path: Path):
    a = write(tmp_path / "a.yaml", "extends: b.yaml\n")
    write(tmp_path / "b.yaml", "extends: c.yaml\n")
    write(tmp_path / "c.yaml", "extends: a.yaml\n")
    (line,) = problems(a)
    assert "extends cycle" in line and "a.yaml" in line and "c.yaml" in line


def test_extends_missing_file_is_an_error(tmp_path: Path):
    a = write(tmp_path / "a.yaml", "extends: nowhere.yaml\n")
    (line,) = problems(a)
    assert "nowhere.yaml: file not found" in line and "a.yaml" in line


def test_missing_config_and_bad_yaml(tmp_path: Path):
    assert problems(tmp_path / "nope.yaml") == [f"{tmp_path / 'nope.yaml'}: file not found"]
    bad = write(tmp_path / "bad.yaml", "model:\n  hidden_size: [1, 2\n")
    (line,) = problems(bad)
    assert line.startswith(f"{bad}:") and "invalid YAML" in line
    lst = write(tmp_path / "list.yaml", "- 1\n- 2\n")
    assert "top level must be a mapping" in problems(lst)[0]


# --------------------------------------------------------------------------- --set


def test_overrides_are_yaml_typed_then_schema_typed(base: Path):
    cfg = load_config(
        base,
        [
            "train.lr=1e-4",
            "train.chaos.kill_at_steps=[25]",
            "data.mix.code=0.3",
            "model.tie_embeddings=false",
            "train.precision=bf16",
        ],
    )
    assert cfg.train.lr == 1e-4
    assert cfg.train.chaos.kill_at_steps == [25]
    assert cfg.data.mix == {"a": 1.0, "b": 3.0, "code": 0.3}
    assert cfg.model.tie_embeddings is False and cfg.train.precision == "bf16"


def test_later_override_wins(base: Path):
    assert load_config(base, ["train.lr=1e-4", "train.lr=5e-4"]).train.lr == 5e-4


@pytest.mark.parametrize(
    "item, expected",
    [
        ("train.lr", "expected KEY=VALUE"),
        ("=3", "expected KEY=VALUE"),
        ("train..lr=3", "empty part"),
        ("train.lr.x=3", "not a section"),
        ("train.lr=[1,", "not valid YAML"),
    ],
)
def test_malformed_override(base: Path, item: str, expected: str):
    (line,) = problems(base, item)
    assert expected in line and item in line


# --------------------------------------------------------------------------- errors


def test_unknown_keys_with_did_you_mean(base: Path):
    lines = problems(base, "train.lrr=3", "modle.x=1", "train.checkpoint.keep_lst=2")
    assert any("train.lrr = 3: unknown key; did you mean 'train.lr'?" in ln for ln in lines)
    assert any("modle = " in ln and "did you mean 'model'?" in ln for ln in lines)
    assert any("did you mean 'train.checkpoint.keep_last'?" in ln for ln in lines)


def test_every_problem_reported_one_line_each_with_file_path_value_rule(base: Path):
    lines = problems(
        base,
        "model.num_heads=5",
        "train.lr=-1",
        "train.precision=fp8",
        "data.seq_len=4096",
        "resource.use_gpu=maybe",
    )
    assert all(ln.startswith(f"{base}: ") for ln in lines)
    assert all("\n" not in ln for ln in lines)
    joined = "\n".join(lines)
    assert "model.num_heads = 5: must divide model.hidden_size (64)" in joined
    assert "train.lr = -1: input should be greater than 0" in joined
    assert "train.precision = 'fp8'" in joined
    assert "resource.use_gpu = 'maybe'" in joined
    # Broken `train` and `resource` sections do not hide the model and data rules.
    assert "data.seq_len = 4096: must be <= model.max_seq_len (1024)" in joined
    assert len(lines) == 5


def test_bounds(base: Path):
    for item in (
        "model.hidden_size=4",
        "data.grad_accum_steps=0",
        "resource.num_workers=0",
        "parallel.zero_stage=4",
        "train.checkpoint.keep_last=0",
        "model.arch=gpt3",
    ):
        assert problems(base, item), item


# --------------------------------------------------------------------------- cross-field rules


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["resource.num_workers=3", "parallel.dp=2"],
            "tp*pp*dp = 2 must equal resource.num_workers (3)",
        ),
        (
            ["parallel.pp=3", "resource.num_workers=3", "parallel.dp=1"],
            "parallel.pp_microbatches = None: no count >= pp (3) divides the 2 rows",
        ),
        (["model.num_heads=3"], "model.num_heads = 3: must divide model.hidden_size (64)"),
        (["model.num_kv_heads=3"], "model.num_kv_heads = 3: must divide model.num_heads (4)"),
        (
            [
                "model.num_heads=8",
                "model.num_kv_heads=2",
                "parallel.tp=4",
                "resource.num_workers=4",
                "parallel.dp=1",
            ],
            "parallel.tp = 4: must divide model.num_kv_heads (2)",
        ),
        (
            ["parallel.tp=8", "resource.num_workers=8", "parallel.dp=1"],
            "parallel.tp = 8: must divide model.num_heads (4)",
        ),
        (["data.seq_len=2048"], "data.seq_len = 2048: must be <= model.max_seq_len (1024)"),
        (["train.warmup_steps=50"], "train.warmup_steps = 50: must be < train.total_steps (50)"),
        (["parallel.zero_stage=3"], "strategy ddp runs ZeRO stage 0 or 1"),
        (["parallel.strategy=fsdp", "parallel.zero_stage=1"], "stages 0-1 need strategy ddp"),
        (["model.arch=gpt2", "model.num_kv_heads=2"], "arch gpt2 has no grouped-query attention"),
        (["model.hidden_size=68", "model.num_heads=4"], "must be even for RoPE"),
        (["train.precision=fp16"], "fp16 needs a GPU"),
        (["train.chaos.kill_at_steps=[10, 60]"], "train.chaos.kill_at_steps = 60: must be <"),
        (
            [
                "resource.use_gpu=true",
                "resource.gpus_per_node=2",
                "parallel.tp=4",
                "resource.num_workers=4",
                "parallel.dp=1",
            ],
            "must be <= resource.gpus_per_node (2)",
        ),
        (["parallel.sequence_parallel=true"], "needs parallel.tp > 1"),
        (["model.attention=flex"], "model.attention = 'flex': FlexAttention has no backward on CPU"),
        (
            ["model.attention=flex", "resource.use_gpu=true", "model.dropout=0.1"],
            "model.attention = 'flex': FlexAttention has no dropout",
        ),
    ],
)
def test_cross_field_rule(base: Path, overrides: list[str], expected: str):
    lines = problems(base, *overrides)
    assert any(expected in ln for ln in lines), lines


def test_rules_hold_when_constructing_in_code():
    with pytest.raises(ValueError, match="must divide model.hidden_size"):
        ExperimentConfig.model_validate({"name": "x", "model": {"num_heads": 3}})


def test_explicit_strategy_fills_layout(base: Path):
    cfg = load_config(base)
    p = cfg.parallel
    assert (p.tp, p.pp, p.dp, p.zero_stage) == (1, 1, 2, 0)
    assert cfg.global_batch_size == 2 * 1 * 2
    assert load_config(base, ["parallel.strategy=fsdp"]).parallel.zero_stage == 3


def test_model_defaults_by_family(base: Path):
    llama = load_config(base, ["model.hidden_size=4096", "model.num_heads=32"]).model
    assert llama.ffn_hidden_size == 11008 and llama.num_kv_heads == 32  # Llama-2-7B's width
    gpt2 = load_config(base, ["model.arch=gpt2"]).model
    assert gpt2.ffn_hidden_size == 4 * 64


# --------------------------------------------------------------------------- identity


def test_config_hash_tracks_what_is_trained_not_the_record(base: Path):
    a = load_config(base)
    assert config_hash(a) == config_hash(
        load_config(base, ["purpose=other", "name=other", "train.checkpoint.every_steps=7"])
    )
    assert config_hash(a) != config_hash(load_config(base, ["train.lr=1e-4"]))
    assert config_hash(a) != config_hash(load_config(base, ["data.mix.a=2"]))


def test_flatten_gives_dotted_keys(base: Path):
    flat = flatten(load_config(base).model_dump(mode="json"))
    assert flat["data.mix.a"] == 1.0 and flat["train.lr"] == 1e-3
    assert flat["train.chaos.kill_at_steps"] == []
    assert yaml.safe_load(to_yaml(load_config(base)))["data"]["mix"] == {"a": 1.0, "b": 3.0}


def test_set_on_a_string_field_takes_the_text_as_written():
    """YAML would read "loss goes down: below 8.5" as a mapping; a string field takes
    the text. Lists, numbers and sections are still parsed as YAML."""
    from tests.conftest import RECIPES
    from trainlab.config import load_config

    cfg = load_config(
        RECIPES / "tiny.yaml",
        [
            "expectation=loss goes down: below 8.5",
            "purpose=[not, a, list]",
            "train.runs_root=/tmp/x: y",
            "owner=null",
            "train.lr=1e-3",
            "data.mix={code: 1, docs: 2}",
        ],
    )
    assert cfg.expectation == "loss goes down: below 8.5"
    assert cfg.purpose == "[not, a, list]"
    assert cfg.train.runs_root == "/tmp/x: y"
    assert cfg.owner == ""  # null: back to its default, as for any field
    assert cfg.train.lr == 1e-3 and cfg.data.mix == {"code": 1.0, "docs": 2.0}


def test_attention_kernels_are_not_the_experiment():
    """`model.attention: auto | sdpa | flex | eager` run the same attention with
    different kernels: one config hash (sdpa's, the default before `auto`), so a
    run started before `auto` existed resumes; a change of the model is not."""
    from tests.conftest import RECIPES
    from trainlab.config import config_hash, load_config

    gpu = ["resource.use_gpu=true", "model.dropout=0"]  # flex trains on CUDA only
    hashes = {
        name: config_hash(load_config(RECIPES / "tiny.yaml", [f"model.attention={name}", *gpu]))
        for name in ("auto", "sdpa", "flex", "eager")
    }
    assert config_hash(load_config(RECIPES / "tiny.yaml")) == hashes["auto"]
    assert len(set(hashes.values())) == 1, hashes
    other = load_config(RECIPES / "tiny.yaml", ["model.num_heads=8"])
    assert config_hash(other) != hashes["sdpa"]


def test_a_key_with_a_word_added_suggests_the_key_not_a_lookalike():
    """`train.lr_rate` means `train.lr` (difflib alone said `train.min_lr_ratio`);
    a plain misspelling still gets the closest spelling."""
    from trainlab.config.loader import suggest

    train_keys = ["lr", "min_lr_ratio", "total_steps", "warmup_steps"]
    assert suggest("lr_rate", train_keys) == "lr"
    assert suggest("max_lr", train_keys) == "lr"
    assert suggest("total_step", train_keys) == "total_steps"
    assert suggest("zzz", train_keys) is None
