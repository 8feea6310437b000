"""The ``native`` layout's Triton backend: ``backend.c`` (built by the project's install, ``setup.py``)
declares the backend API it calls in ``triton_api.h`` and runs the fused ranker's
Python code (:mod:`ensemble.serving.embedded`) in an interpreter embedded in Triton's process.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Capabilities:
    """What a backend library says it does (its exported ``ensemble_backend_capabilities()``)."""

    api: str | None  # the version of the C entry points it calls (ensemble/native/api.h); None: it does not say
    features: frozenset[str]


def capabilities(path: Path) -> Capabilities:
    """Asks a backend library (loaded, not run: Triton's symbols stay unresolved) what it does. A library
    built before it could say answers ``Capabilities(None, frozenset())``.

    Raises:
        OSError: the file is missing or not a library of this machine.
    """
    import ctypes
    import os

    lib = ctypes.CDLL(str(path), mode=os.RTLD_LAZY | os.RTLD_LOCAL)
    try:
        said = lib.ensemble_backend_capabilities
    except AttributeError:
        return Capabilities(None, frozenset())
    said.restype = ctypes.c_char_p
    words = said().decode().split()
    api = next((w.split("=", 1)[1] for w in words if w.startswith("api=")), None)
    return Capabilities(api, frozenset(w for w in words if "=" not in w))


def installed_api() -> str | None:
    """The version of the C entry points the installed modules offer (None: not built)."""
    try:
        from ensemble.native import _request
    except ImportError:
        return None
    found = [m.group(1) for name in dir(_request) if (m := re.fullmatch(r"_C_API_(\d+)", name))]
    return found[0] if found else None
