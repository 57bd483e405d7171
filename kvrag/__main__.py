"""``python -m kvrag`` == the ``kvrag`` console command."""

import sys

from kvrag.cli import main

sys.exit(main())
