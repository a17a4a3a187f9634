"""``python -m engine.serve``: runs engine/entrypoints/serve.py."""

import sys

from engine.entrypoints.serve import main

if __name__ == "__main__":
    sys.exit(main())
