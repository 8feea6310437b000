"""The ``native`` layout's Triton backend: ``backend.c`` (built by the project's install, ``setup.py``)
declares the backend API it calls in ``triton_api.h`` and runs the fused ranker's
Python code (:mod:`ensemble.serving.embedded`) in an interpreter embedded in Triton's process.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
# The backend's name in a model config (``backend: "native"``), named after the layout that uses it.
NATIVE_BACKEND = "native"
FILE_NAME = f"libtriton_{NATIVE_BACKEND}.so"  # the name Triton looks for in a model's version folder


class NotBuilt(RuntimeError):
    """The backend library was not compiled (no C compiler or Python headers at install)."""


def library() -> Path:
    """The compiled backend (``pip install -e .`` builds it next to its source)."""
    built = sorted(HERE.glob(f"libtriton_{NATIVE_BACKEND}*.so"))
    if not built:
        raise NotBuilt(f"the native layout's backend is not built (no {HERE}/libtriton_{NATIVE_BACKEND}*.so): "
                       "install the project with a C compiler and Python's headers (make setup)")
    return built[0]
