#!/usr/bin/env python
"""Training throughput (tokens/s, TFLOP/s, MFU, peak memory): a thin wrapper over ``megaformer bench``.

python tools/throughput.py configs/quickstart.yaml [KEY=VALUE ...] [--steps N] [--compare-hf]
"""

import sys

from megaformer.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
