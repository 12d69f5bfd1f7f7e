#!/usr/bin/env python
"""FLOPs per token/step and MFU of a config: a thin wrapper over ``megaformer flops``.

python tools/flops.py configs/llama-7b.yaml --gpu H100-SXM --gpus 64 --step-time 5.2 [--json]
"""

import sys

from megaformer.cli import main

if __name__ == "__main__":
    sys.exit(main(["flops", *sys.argv[1:]]))
