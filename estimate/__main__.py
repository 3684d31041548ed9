"""python -m estimate: the table of every numbered script's predicted GPU memory."""
import sys

from estimate.table import main

sys.exit(main())
