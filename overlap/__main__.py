"""``python -m overlap ...``: see ``overlap.cli``."""
import sys

from overlap.cli import main

if __name__ == "__main__":
    sys.exit(main())
