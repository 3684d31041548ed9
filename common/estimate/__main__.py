"""python -m common.estimate: the table of every numbered script's predicted GPU memory."""
import sys

from common.estimate.table import main

sys.exit(main())
