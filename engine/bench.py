"""``python -m engine.bench``: runs engine/tools/bench.py."""

import sys

from engine.tools.bench import main

if __name__ == "__main__":
    sys.exit(main())
