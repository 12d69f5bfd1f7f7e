#!/usr/bin/env python
"""Checkpoint conversion (megaformer <-> Hugging Face, reshard): a thin wrapper over ``megaformer convert``.

python tools/convert.py runs/quickstart hf/quickstart --to hf --arch llama
python tools/convert.py hf/model runs/continued --to megaformer --tp 2 --pp 2
"""

import sys

from megaformer.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
