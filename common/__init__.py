"""What the numbered scripts import: one job per module, the same in every script.

A copied script needs itself and this folder, nothing else (README: "Copying a script"). The
two larger tools are packages of their own beside it: `estimate` (predicts GPU memory on fake
tensors; a script imports it only under --estimate) and `tour` (runs every step and draws the
report).
"""
from common.library_warnings import silence

silence()  # before a script imports the libraries (common/library_warnings.py)
