"""`trainlab validate | show | plan` as a user runs them: exit codes, output, speed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from tests.conftest import RECIPES, REPO

TINY = str(RECIPES / "tiny.yaml")
BIG = str(RECIPES / "llama_1b.yaml")


def trainlab(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainlab", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_validate_ok_prints_resolved_name():
    out = trainlab("validate", TINY, "--set", "name=tiny_lr", "--set", "train.lr=1e-4")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok tiny_lr"


def test_validate_errors_exit_2_one_line_each_no_traceback():
    out = trainlab("validate", TINY, "--set", "model.num_heads=7", "--set", "train.lrr=1")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) >= 2 and all(ln.startswith("error: ") for ln in lines)
    assert "Traceback" not in out.stderr and out.stdout == ""
    assert any("model.num_heads = 7: must divide model.hidden_size (128)" in ln for ln in lines)
    assert any("did you mean 'train.lr'" in ln for ln in lines)


def test_bad_flags_and_missing_file_exit_2():
    assert trainlab("validate", "nope.yaml").returncode == 2
    assert trainlab("validate", TINY, "--set", "novalue").returncode == 2
    assert trainlab("validate").returncode == 2  # missing argument (click usage error)
    assert trainlab("plan", TINY, "--frobnicate").returncode == 2


def test_show_prints_resolved_yaml():
    out = trainlab("show", TINY, "--set", "data.mix.code=0.7")
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    assert "extends" not in cfg and cfg["name"] == "tiny"
    assert cfg["data"]["mix"]["code"] == 0.7 and cfg["model"]["hidden_size"] == 128
    assert cfg["parallel"]["dp"] == 2  # resolved, not left for later


def test_plan_json_has_the_documented_keys():
    out = trainlab("plan", BIG, "--json")
    assert out.returncode == 0, out.stderr
    p = json.loads(out.stdout.strip().splitlines()[-1])
    assert isinstance(p["num_params"], int) and p["num_params"] == 1_100_048_384
    assert p["world_size"] == 8 and p["fits"] is True
    assert set(p["parallel"]) == {"tp", "pp", "dp", "zero_stage"}
    # by category of what the trainer allocates (trainlab.plan.memory)
    assert set(p["memory_per_device_bytes"]) == {
        "parameters",
        "gradients",
        "optimizer",
        "communication",
        "activations",
        "logits_loss",
        "checkpoint_snapshot",
        "framework",
        "total",
    }
    assert p["flops_per_token"] > 6 * p["num_params"]
    assert p["micro_batch_size_max"] >= 1 and p["notes"]


def test_plan_table_and_not_fitting_exit_2():
    out = trainlab("plan", TINY)
    assert out.returncode == 0 and "GiB" in out.stdout and "parameters" in out.stdout
    bad = trainlab("plan", BIG, "--set", "resource.gpu_memory_gb=2", "--json")
    assert bad.returncode == 2
    assert json.loads(bad.stdout)["fits"] is False
    assert "does not fit" in bad.stderr and "GiB device memory" in bad.stderr


def test_config_commands_import_neither_ray_nor_torch():
    code = (
        "import sys\n"
        "from trainlab.cli import cli\n"
        f"for args in (['validate', {TINY!r}], ['show', {TINY!r}], ['plan', {BIG!r}, '--json']):\n"
        "    cli.main(args=args, standalone_mode=False)\n"
        "heavy = sorted(m for m in ('ray', 'torch', 'mlflow', 'pyarrow') if m in sys.modules)\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "HEAVY []"


def test_registered_names_are_checked_at_validate_without_torch():
    """Attention and optimizer names are the registries' (read without importing
    torch): a typo fails `validate`, not the run's workers."""
    out = trainlab(
        "validate", TINY, "--set", "model.attention=flexx", "--set", "train.optimizer.name=adam"
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert (
        "model.attention = 'flexx': unknown attention; did you mean 'flex'? "
        "available: auto, eager, flex, sdpa"
    ) in out.stderr
    assert "train.optimizer.name = 'adam': unknown name; did you mean 'adamw'?" in out.stderr
    out = trainlab(
        "validate", TINY, "--set", "train.optimizer.name=muon", "--set", "train.optimizer.momentum=1.5"
    )
    assert out.returncode == 2
    assert "train.optimizer.momentum = 1.5: input should be less than 1" in out.stderr
    code = (
        "import sys; from trainlab.config import load_config; "
        f"load_config({TINY!r}, ['train.optimizer.name=muon', 'model.attention=eager']); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


def test_moved_optimizer_fields_are_refused_by_their_new_name_and_the_hash_holds():
    """train.beta1 (and weight_decay, beta2, eps) moved to train.optimizer: the old
    spelling is refused in one line naming the new one, and the hash of an AdamW
    experiment is what it was before train.optimizer existed (its runs still resume)."""
    from trainlab.config import config_hash, load_config
    from trainlab.config.loader import identity_dict
    from trainlab.errors import UserError

    with pytest.raises(UserError) as e:
        load_config(TINY, ["train.beta1=0.8"])
    assert "train.beta1 is now train.optimizer.beta1" in str(e.value)
    new = load_config(TINY, ["train.optimizer.beta1=0.8", "train.optimizer.weight_decay=0.05"])
    assert new.train.optimizer.name == "adamw" and new.train.optimizer.beta1 == 0.8
    # AdamW's fields sit where they did before train.optimizer: the same hash.
    plain = load_config(TINY)
    identity = identity_dict(plain)["train"]
    assert "optimizer" not in identity and identity["beta2"] == 0.95
    assert config_hash(load_config(TINY, ["train.optimizer.name=muon"])) != config_hash(plain)


def test_plan_piped_is_not_wrapped_at_80_columns(capsys):
    """Piped (a file, `| less`, CI), rich assumed 80 columns and broke the plan's
    notes mid-sentence; `data inspect`, prep's summary and compare print alike."""
    import pytest

    from trainlab.cli import main

    with pytest.raises(SystemExit) as e:
        main(["plan", BIG])
    out = capsys.readouterr().out
    assert e.value.code == 0
    (line,) = [ln for ln in out.splitlines() if "global batch 256 = " in ln]
    assert line.rstrip().endswith("set data.global_batch_size to keep it fixed"), line
    assert max(len(ln) for ln in out.splitlines()) > 80
