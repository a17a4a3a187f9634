"""``python -m engine.bench``: runs engine/entrypoints/bench.py."""

import sys

from engine.entrypoints.bench import main

if __name__ == "__main__":
    sys.exit(main())
