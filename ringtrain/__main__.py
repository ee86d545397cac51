"""``python -m ringtrain`` is the ``ringtrain`` command."""

import sys

from ringtrain.cli import main

sys.exit(main())
