"""``python -m eval_harness RECIPE [--set key=value ...]``: see :mod:`eval_harness.cli`."""

import sys

from .cli import main

sys.exit(main())
