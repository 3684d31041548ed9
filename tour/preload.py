"""Imported by the tour's fork server alone (tour/warm.py), before it forks a child for each
single-process step: the modules the numbered scripts import (warm.SCRIPTS_MODULES), so that no
step imports them again. A module that fails to import here is left to the step, which imports
it itself and says what is wrong."""
import importlib
import sys

from tour.warm import SCRIPTS_MODULES

for name in SCRIPTS_MODULES:
    before = set(sys.modules)
    try:
        importlib.import_module(name)
    except Exception:  # noqa: BLE001 (a broken optional library must not stop the tour)
        for partly in set(sys.modules) - before:  # the step imports it anew, as a fresh Python
            del sys.modules[partly]
