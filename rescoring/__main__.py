"""``python -m lmserve.rescoring``: the same as ``lm-rescore``."""

import sys

from lmserve.rescoring.commands.cli import main

sys.exit(main())
