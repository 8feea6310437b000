"""``python -m ensemble.native [--strict]``: which C modules this install built (:mod:`ensemble.native.built`)."""

import sys

from ensemble.native.built import main

sys.exit(main())
