"""python -m tour: every numbered script, the GPU estimate, then the tables and charts."""
import sys

from tour.runner import main

sys.exit(main())
