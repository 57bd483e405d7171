"""``python -m kvrag.cli`` == the ``kvrag`` console command."""
import sys

from kvrag.cli import main

sys.exit(main())
