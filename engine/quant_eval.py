"""``python -m engine.quant_eval``: runs engine/tools/quant_eval.py."""

import sys

from engine.tools.quant_eval import main

if __name__ == "__main__":
    sys.exit(main())
