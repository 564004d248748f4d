"""Entry script for `ray job submit --working-dir . -- python trainers/pretrain.py CONFIG`.

The same as `trainlab train` (arguments and exit codes), so a submitted job and a
local run behave alike. `platform/` is the library's source root and never a
package: the working dir that Ray puts first on PYTHONPATH cannot shadow the
standard library's `platform` module.
"""

import sys
from pathlib import Path

try:
    import trainlab  # noqa: F401 - installed, or shipped with py_modules
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from trainlab.cli import main

if __name__ == "__main__":
    main(["train", *sys.argv[1:]])
