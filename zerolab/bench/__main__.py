"""`python -m zerolab.bench`: see zerolab/bench/runner.py."""

import sys

from zerolab.bench.runner import main

if __name__ == "__main__":  # a rank started by `spawn` runs this file again: it must not launch
    sys.exit(main())
