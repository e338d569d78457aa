"""``python -m lmserve.training``: the same as ``lm-train``."""

import sys

from lmserve.training.cli import main

sys.exit(main())
