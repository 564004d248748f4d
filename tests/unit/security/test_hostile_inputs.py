"""What a malicious config or checkpoint file cannot do (docs/security.md): run
code when read, or make the reader build or print without bound. Configs are read
with yaml.safe_load semantics within bounds; checkpoint files with
torch.load(weights_only=True)."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import RECIPES
from trainlab.config import load_config
from trainlab.errors import ConfigError, UserError
from trainlab.train import checkpoint as ck

TINY = str(RECIPES / "tiny.yaml")


class _Planted:
    """Unpickling this calls Path.touch(marker): code execution by loading a file."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def test_a_checkpoint_file_cannot_run_code_when_loaded(tmp_path):
    marker = tmp_path / "code-ran"
    path = tmp_path / "model.pt"
    torch.save({"weight": torch.zeros(2), "payload": _Planted(marker)}, path)
    with pytest.raises(Exception, match="(?i)weights_only|unsupported global"):
        ck.load_file(path)
    assert not marker.exists()


def test_a_config_cannot_run_code_when_read(tmp_path):
    marker = tmp_path / "code-ran"
    config = tmp_path / "exp.yaml"
    config.write_text(f'name: !!python/object/apply:pathlib.Path.touch ["{marker}"]\n')
    with pytest.raises(UserError, match="invalid YAML"):
        load_config(config)
    assert not marker.exists()


# --------------------------------------------------------------------------- bounded YAML
# A config is read within bounds (trainlab.boundedyaml): what a few bytes of YAML
# can make the reader build or print is limited, and each refusal is one line.


def _alias_bomb(levels: int = 9, width: int = 9) -> str:
    """Nested anchors: a few hundred bytes that expand to width**levels nodes."""
    lines = [f"a0: &a0 [{', '.join(['x'] * width)}]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]")
    return "\n".join(lines) + "\n"


def _capped(limit_bytes: int):
    """preexec_fn: cap the child's address space, so a reader that expands the
    bomb dies of MemoryError instead of taking the machine."""
    import resource

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    return cap


def _validate(*args: str) -> subprocess.CompletedProcess:
    """`trainlab validate` in a child capped at 2 GiB of address space and 60 s."""
    return subprocess.run(
        [sys.executable, "-m", "trainlab", "validate", *args],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=_capped(2 << 30),
    )


def _one_error_line(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr[-2000:]
    return lines[0]


def test_an_alias_bomb_in_a_config_is_refused_fast_in_one_line(tmp_path):
    config = tmp_path / "bomb.yaml"
    config.write_text(f"extends: {TINY}\n{_alias_bomb()}")
    start = time.monotonic()
    line = _one_error_line(_validate(str(config)))
    assert time.monotonic() - start < 15  # the interpreter's start included
    assert str(config) in line and "nodes with its aliases expanded" in line


def test_an_alias_bomb_in_a_set_value_is_refused_in_one_line():
    bomb = "{" + _alias_bomb().strip().replace("\n", ", ") + "}"
    line = _one_error_line(_validate(TINY, "--set", f"data.mix={bomb}"))
    assert line.startswith("error: --set 'data.mix=") and "aliases expanded" in line


@pytest.mark.parametrize("kind", ["block", "flow"])
def test_a_mapping_nested_10000_deep_is_refused_in_one_line(tmp_path, kind):
    depth = 10_000
    if kind == "block":  # indentation grows quadratically: stay under the size limit
        depth = 1_000
        text = "".join(" " * i + f"k{i}:\n" for i in range(depth)) + " " * depth + "v\n"
    else:
        text = "k: " + "{a: " * depth + "1" + "}" * depth + "\n"
    config = tmp_path / "deep.yaml"
    config.write_text(text)
    line = _one_error_line(_validate(str(config)))
    assert str(config) in line and "nested deeper than 64 levels" in line


def test_a_deep_set_value_is_refused_in_one_line():
    value = "[" * 10_000 + "]" * 10_000
    line = _one_error_line(_validate(TINY, "--set", f"train.chaos.kill_at_steps={value}"))
    assert "--set" in line and "nested deeper than 64 levels" in line and len(line) < 500


def test_a_config_file_over_the_size_limit_is_refused_unread(tmp_path):
    config = tmp_path / "huge.yaml"
    config.write_text(f"extends: {TINY}\nname: {'a' * 10_000_000}\n")
    line = _one_error_line(_validate(str(config)))
    assert str(config) in line and "more than the limit of 1048576" in line
    assert len(line) < 500


def test_a_long_value_in_a_field_with_a_rule_is_quoted_short(tmp_path):
    config = tmp_path / "long.yaml"
    config.write_text(f"extends: {TINY}\nname: {'a' * 900_000}\n")  # under the size limit
    line = _one_error_line(_validate(str(config)))
    assert "name = 'aaaa" in line and "... (900002 chars)" in line and len(line) < 500


def test_a_10mb_set_value_is_refused_with_a_short_line():
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [f"name={'a' * 10_000_000}"])
    assert len(e.value.lines) == 1 and len(e.value.lines[0]) < 500
    assert "more than the limit" in e.value.lines[0]


def test_a_long_set_value_in_a_field_with_a_rule_is_quoted_short():
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [f"name={'b' * 500_000}"])
    (line,) = e.value.lines
    assert "name = 'bbbb" in line and "(500002 chars)" in line and len(line) < 500


def test_ordinary_anchors_and_merge_keys_still_load(tmp_path):
    config = tmp_path / "anchors.yaml"
    config.write_text(
        f"extends: {TINY}\n"
        "x-common: &common {lr: 0.001, total_steps: 70}\n"
        "train: {<<: *common}\n"
    )
    # an unknown top-level key is the only problem: the anchors themselves are fine
    with pytest.raises(ConfigError) as e:
        load_config(config)
    assert [ln for ln in e.value.lines if "x-common" not in ln] == []
