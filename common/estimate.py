"""Predict a script's peak GPU memory on fake tensors (work in progress)."""
import sys


def estimate(script, argv):
    sys.exit("--estimate is not available yet")
