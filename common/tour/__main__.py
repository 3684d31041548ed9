"""python -m common.tour: every numbered script, the GPU estimate, then the tables and charts."""
import sys

from common.tour.runner import main

sys.exit(main())
