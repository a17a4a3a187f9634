"""``python -m engine.generate``: runs engine/entrypoints/generate.py."""

import sys

from engine.entrypoints.generate import main

if __name__ == "__main__":
    sys.exit(main())
