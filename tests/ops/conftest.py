"""Puts this folder on sys.path so tests import the float64 oracles as ``linear_oracles``."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
