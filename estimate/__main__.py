"""python -m estimate: the table of every numbered script's predicted GPU memory."""
import sys

from common.cli import run_main
from estimate.command import main

sys.exit(run_main(main))  # Ctrl-C between estimates: one line, no traceback
