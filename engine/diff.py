"""``python -m engine.diff``: runs engine/entrypoints/diff.py."""

import sys

from engine.entrypoints.diff import main

if __name__ == "__main__":
    sys.exit(main())
