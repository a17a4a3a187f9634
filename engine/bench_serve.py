"""``python -m engine.bench_serve``: runs engine/entrypoints/bench_serve.py."""

import sys

from engine.entrypoints.bench_serve import main

if __name__ == "__main__":
    sys.exit(main())
