"""``python -m activationscope``: the same command as the ``activationscope`` console script."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
