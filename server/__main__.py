"""``python -m lmserve.server``: the same as ``lm-serve``."""

import sys

from lmserve.server.cli import main

sys.exit(main())
