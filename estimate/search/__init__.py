"""--gpu-memory's searches: the largest batch or micro-batch of each script that fits, and the stack,
a walk along estimate/stack.py's chain priced by its cost model. They ask estimate/question.py for
every figure and take their words and workers from estimate/output.py, nothing else of estimate/
(tests/repository/test_imports.py checks it)."""
