import sys

from ensemble.cli import main

sys.exit(main())
