"""The tour: every numbered script in turn, the GPU estimate, then one table and two charts.

  python -m tour          # runner.py: runs the steps, then report.py writes the report
  python -m tour.report   # rebuilds the tables (report.py) and charts (charts.py) from
                                 # the JSON records in results/ (records.py reads them)

machine.py names the machine under each table; publish.py copies a tour's report into docs/
(--publish) and writes the tables the README and the chapters embed from it; partial.py merges
the rows of some steps into the tables published there (--publish DIR --steps NN).

No numbered script imports this package: it only starts them, each in its own process.
"""
