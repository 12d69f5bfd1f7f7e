import sys

from megaformer.cli import main

sys.exit(main())
