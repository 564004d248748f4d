"""Entry script for `ray job submit`: the same as `trainlab prep ARGS...`.

python data_prep/prep.py data_prep/sources/demo.yaml --out data/demo/prepared
"""

import sys

from trainlab.cli import main

if __name__ == "__main__":
    main(["prep", *sys.argv[1:]])
