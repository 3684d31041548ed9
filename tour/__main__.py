"""python -m tour: every numbered script, the GPU estimate, then the tables and charts."""
import sys

from common.cli import run_main
from tour.runner import main

sys.exit(run_main(main))  # Ctrl-C: one line, the steps running ended, earlier results kept
