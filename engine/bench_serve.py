"""``python -m engine.bench_serve``: runs engine/tools/bench_serve.py."""

import sys

from engine.tools.bench_serve import main

if __name__ == "__main__":
    sys.exit(main())
