"""`python -m mixprec ...` is the `mixprec` command; so is `torchrun ... -m mixprec compare ...`."""

import sys

from mixprec.cli import main

if __name__ == "__main__":
    sys.exit(main())
