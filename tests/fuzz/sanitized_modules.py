"""A pytest plugin (``-p tests.fuzz.sanitized_modules``): the package from ``$ENSEMBLE_SANITIZED_LIB``
(tests/fuzz/sanitize.py builds it there, its C modules compiled with the sanitizers) instead of the
source tree, imported before any test module can import the other one."""

import importlib
import os
import sys
from pathlib import Path

from tests.fuzz.sanitize import MODULES

LIB = Path(os.environ["ENSEMBLE_SANITIZED_LIB"]).resolve()
sys.path.insert(0, str(LIB))
for _name in MODULES:
    _module = importlib.import_module(_name)
    if not Path(_module.__file__).resolve().is_relative_to(LIB):
        raise ImportError(f"{_name} came from {_module.__file__}, not from the sanitized build in {LIB}")
if "libasan" not in os.environ.get("LD_PRELOAD", ""):
    raise ImportError("the sanitized modules need gcc's libasan preloaded (LD_PRELOAD)")


def pytest_report_header(config):
    return f"C modules: the sanitized build in {LIB}"
