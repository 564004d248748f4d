"""Build the demo corpus: `python data_prep/build_demo_corpus.py [--out DIR] [--max-mb N]`.

The logic is devtools/demo_corpus.py; see there for what goes in.
"""

import argparse
import json
import sys
from pathlib import Path

# devtools/ sits at the repository root, beside this script's folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from devtools.demo_corpus import DEMO_RAW, build_demo_corpus  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(DEMO_RAW), help="where to write (default %(default)s)")
    parser.add_argument("--max-mb", type=float, default=6.0, help="cap per domain, MB of raw input")
    parser.add_argument(
        "--with-site-packages",
        action="store_true",
        help="code domain also from site-packages (the >= 100 MB benchmark size)",
    )
    args = parser.parse_args()
    print(json.dumps(build_demo_corpus(args.out, args.max_mb, args.with_site_packages), indent=2))
