"""The decided layout: platform/ is a source root, never a package.

A `platform/__init__.py` would shadow the standard library's `platform` for any
process whose first PYTHONPATH entry is the repo root, which is exactly how Ray
starts workers for `ray job submit --working-dir .`: `import uuid` then fails.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO


def test_platform_is_not_a_package():
    assert not (REPO / "platform" / "__init__.py").exists()
    assert (REPO / "platform" / "trainlab" / "__init__.py").exists()


def test_repo_root_first_on_path_keeps_stdlib_platform():
    code = (
        "import uuid, platform, sys, sysconfig;"
        "assert platform.__file__.startswith(sysconfig.get_paths()['stdlib']), platform.__file__;"
        "platform.system(); uuid.uuid4();"
        "import trainlab; print('ok')"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
