"""`extends:` (and the config file itself) reads regular files only, within the
size bound, and a file that is not a trainlab config never has its content
echoed (docs/security.md, "A config reads only what it names, and echoes no
other file"). No test reads a real system file: the "shadow" file is written
here."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import RECIPES
from trainlab.config import load_config
from trainlab.errors import ConfigError

TINY = RECIPES / "tiny.yaml"

# Lines of an /etc/shadow: YAML reads each as a key (each ends in ':').
SHADOW = (
    "root:$6$Zq8salt$Secr3tHashValueXYZ/abc.:19000:0:99999:7:::\n"
    "daemon:*:19000:0:99999:7:::\n"
    "alice:$y$j9T$An0therSecr3t$qwerty:19500:0:99999:7:::\n"
)
# ... and with the trailing fields dropped, one multi-line string.
SHADOW_STRING = "root:$6$Zq8salt$Secr3tHashValueXYZ/abc.\ndaemon:*:19000\n"
SECRET_BITS = ("$6$", "Secr3t", "daemon", "alice", "19000", "qwerty")


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def one_line(path: Path) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert len(e.value.lines) == 1, e.value.lines
    return e.value.lines[0]


def no_secret(line: str) -> None:
    assert not any(bit in line for bit in SECRET_BITS), line


def in_thread(fn, timeout: float = 10.0):  # noqa: ANN001, ANN201
    """fn()'s result or exception, or a failure when it is still running after
    `timeout` seconds (it would hang the reader)."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    return t.is_alive(), box


# --------------------------------------------------------------------------- not a config


@pytest.mark.parametrize("content", [SHADOW, SHADOW_STRING], ids=["keys", "string"])
def test_extends_a_shadow_like_file_echoes_none_of_it(tmp_path: Path, content: str):
    shadow = write(tmp_path / "etc" / "shadow", content)
    config = write(tmp_path / "exp.yaml", f"extends: {shadow}\nname: exp\n")
    line = one_line(config)
    assert line.startswith(f"{shadow}: not a trainlab config"), line
    no_secret(line)


def test_a_shadow_like_file_as_the_config_echoes_none_of_it(tmp_path: Path):
    shadow = write(tmp_path / "etc" / "shadow", SHADOW)
    line = one_line(shadow)
    assert line == f"{shadow}: not a trainlab config (its top-level keys are not config sections)"


def test_an_extended_file_that_does_not_parse_is_not_echoed(tmp_path: Path):
    # PyYAML names an undefined alias in its message: the file's content.
    secret = write(tmp_path / "secret.env", "password: *Secr3tPassword\n")
    config = write(tmp_path / "exp.yaml", f"extends: {secret}\n")
    line = one_line(config)
    assert line.startswith(f"{secret}:1:") and "not a trainlab config" in line, line
    assert "invalid YAML" in line
    no_secret(line)


def test_an_extended_config_with_a_typo_still_names_the_key(tmp_path: Path):
    base = write(tmp_path / "base.yaml", "modle: {hidden_size: 64}\ntrain: {lr: 1.0e-3}\n")
    config = write(tmp_path / "exp.yaml", "extends: base.yaml\n")
    line = one_line(config)
    assert line.startswith(f"{base}: ") and "'modle'" in line and "did you mean 'model'" in line


# --------------------------------------------------------------------------- not a regular file


def _refused_unread(tmp_path: Path, target: Path, kind: str) -> None:
    config = write(tmp_path / "exp.yaml", f"extends: {target}\n")
    alive, box = in_thread(lambda: load_config(config))
    if alive:  # unblock the reader stuck in open() (FIFO), then fail
        fd = os.open(target, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        pytest.fail(f"reading {target} did not return within 10 s")
    error = box.get("error")
    assert isinstance(error, ConfigError), repr(error)
    assert error.lines == [f"{target}: not a regular file ({kind}); expected a YAML file"]


def test_extends_a_fifo_is_refused_without_blocking(tmp_path: Path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    _refused_unread(tmp_path, fifo, "a FIFO")


def test_extends_a_directory_is_refused(tmp_path: Path):
    (tmp_path / "folder").mkdir()
    _refused_unread(tmp_path, tmp_path / "folder", "a directory")


def test_extends_a_socket_is_refused(tmp_path: Path):
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        _refused_unread(tmp_path, path, "a socket")


def test_extends_dev_zero_returns_fast_in_one_line(tmp_path: Path):
    """Through `trainlab validate`, in a child capped at 1 GiB of address space:
    a reader that reads what /dev/zero gives dies of MemoryError, not the machine."""
    import resource

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    config = write(tmp_path / "exp.yaml", "extends: /dev/zero\nname: exp\n")
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "trainlab", "validate", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=cap,
    )
    assert time.monotonic() - start < 15  # the interpreter's start included
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        "error: /dev/zero: not a regular file (a character device); expected a YAML file"
    ]


# --------------------------------------------------------------------------- loops and cycles


def test_a_symlink_loop_is_one_line(tmp_path: Path):
    (tmp_path / "a.yaml").symlink_to("b.yaml")
    (tmp_path / "b.yaml").symlink_to("a.yaml")
    config = write(tmp_path / "exp.yaml", "extends: a.yaml\n")
    line = one_line(config)
    assert line == f"{tmp_path / 'a.yaml'}: symlink loop (extended from {config})"
    # The config file itself a loop: said so, not "file not found".
    assert one_line(tmp_path / "b.yaml") == f"{tmp_path / 'b.yaml'}: symlink loop"


def test_an_extends_cycle_through_a_symlink_is_one_line(tmp_path: Path):
    config = write(tmp_path / "exp.yaml", f"extends: {tmp_path / 'link.yaml'}\nname: exp\n")
    (tmp_path / "link.yaml").symlink_to(config)
    line = one_line(config)
    assert "extends cycle" in line and str(config) in line


def test_a_regular_extended_file_still_merges(tmp_path: Path):
    link = tmp_path / "base.yaml"
    link.symlink_to(TINY)  # a symlink to a regular file is followed
    config = write(tmp_path / "exp.yaml", "extends: base.yaml\ntrain: {lr: 2.0e-3}\n")
    cfg = load_config(config)
    assert cfg.name == "exp" and cfg.train.lr == 2e-3
    assert cfg.model == load_config(TINY).model
