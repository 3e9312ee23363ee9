"""``python -m iop`` is the ``iop`` command."""

import sys

from iop.cli import main

sys.exit(main())
