"""``python -m overlap ...``: see ``overlap.demo.cli``."""
import sys

from overlap.demo.cli import main

if __name__ == "__main__":
    sys.exit(main())
