"""``python -m engine.quant_eval``: runs engine/entrypoints/quant_eval.py."""

import sys

from engine.entrypoints.quant_eval import main

if __name__ == "__main__":
    sys.exit(main())
