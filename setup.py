"""Only for the compiled parts; everything else is in pyproject.toml.

Every module is optional: a user's build that fails one (no compiler, no headers, a compiler that
warns about something new) still installs, and the slower path that replaces it says so at install
(``make setup`` runs ``python -m ensemble.native``) and at ``ensemble serve`` (a log line and the
``ensemble_c_module_built`` metric). ``ENSEMBLE_C_STRICT=1`` (the project's own CI: ``make test``'s
checks build with it) makes every warning an error and every module required.

- ``ensemble.native._request``: the request path's per-string loops, a Python extension; without
  it ``ensemble.native`` uses its Python loops (slower, same results).
- ``ensemble.native._trees``: the boosted trees as arrays, evaluated tree-major over a batch
  (``ensemble.models.xgb.TreeArrays``); optional like the above (then XGBoost scores the trees).
- ``ensemble.native._dlrm``: either DLRM's forward pass in one C call (``ensemble.models.dlrm_kernel``);
  optional (then TorchScript and LiteRT score the DLRMs).
- ``ensemble.native._tables``: embedding tables larger than memory (``ensemble.tables``): the row store's
  format, the hot tier and the cold reads (io_uring through liburing when its headers are there);
  without it a release with a row store does not load, and says so.
- ``ensemble.native._admission``: the ranker's admission policy in C (``ensemble.serving.admission``
  keeps the Python one, which serves without it); ``ensemble.native._chain``: the whole chain in C
  over the modules above (needs numpy's headers: pyproject.toml's build requirements carry numpy). With both, the
  native backend plans and scores plain requests without Python; without them every request goes
  through the model's execute.
  The modules hand each other their C entry points as capsules (``ensemble/native/api.h``).
- ``ensemble/native/libtriton_native*.so``: the ``native`` layout's Triton backend
  (``ensemble/native/backend*.c``, declared in ``backend_internal.h``). Not a Python module: Triton loads it into
  its own process and it embeds this interpreter's libpython, so it links that library. ``optional=True`` as well: without it
  the ``fused`` and ``ensemble`` layouts still serve (``ensemble serve --layout native`` says why it cannot).
"""

import importlib.util
import os
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

try:  # ensemble.native._chain reads numpy's ufunc struct (numpy/ufuncobject.h)
    import numpy
except ImportError:  # a build without numpy (pyproject.toml's build requirements have it): no chain
    numpy = None

# ensemble.native._openvino links the C runtime the openvino wheel ships (headers and libraries), found
# where that wheel is installed (pyproject.toml's build requirements have it); without it the module is not
# built and a release that declares OpenVINO says so at load (ensemble.models.engines). The module finds the
# library beside it in site-packages ($ORIGIN), or where the build found it (an editable install).
_OPENVINO = importlib.util.find_spec("openvino")
OPENVINO = Path(_OPENVINO.origin).parent if _OPENVINO and _OPENVINO.origin else None
OPENVINO_C = sorted((OPENVINO / "libs").glob("libopenvino_c.so.*")) if OPENVINO else []

PYTHON_LIBRARY = sysconfig.get_config_var("INSTSONAME") or "libpython3.11.so.1.0"
LIBRARY_NAME = sysconfig.get_config_var("LDVERSION") or "3.11"
API = ["ensemble/native/api.h"]  # the C entry points the modules hand each other
# Unused parameters are allowed: Python's and Triton's callback signatures (self, kwargs, backend) take
# arguments a function may not need. Warnings are errors, and every module required, only in the project's
# own checks (ENSEMBLE_C_STRICT=1): another compiler's new warning must not cost a user the module.
STRICT = os.environ.get("ENSEMBLE_C_STRICT") == "1"
WARNINGS = ["-Wall", "-Wextra", "-Wno-unused-parameter", *(["-Werror"] if STRICT else [])]

NATIVE = "ensemble/native"  # every C source of the project, and the modules built from them


def module(name: str, *flags: str, include: tuple[str, ...] = (), **kwargs) -> Extension:
    """ensemble.native.<name> from ensemble/native/<name>.c; optional: a failed build leaves it out."""
    return Extension(f"ensemble.native.{name}", [f"{NATIVE}/{name}.c"], optional=not STRICT, depends=API,
                     include_dirs=[NATIVE, *include], extra_compile_args=[*WARNINGS, *flags], **kwargs)


# ensemble.native._tables reads cold rows through io_uring when liburing's headers are here (Debian's
# liburing-dev, which `make setup` installs); without them it is built with pread and mmap only.
URING = Path("/usr/include/liburing.h").is_file()
# ... and from a Redis Cluster when hiredis's headers are here (Debian's libhiredis-dev): the cold tier of a fleet.
HIREDIS = Path("/usr/include/hiredis/hiredis.h").is_file()

MODULES = [
    module("_request", "-O2", libraries=["z"]),
    module("_admission", "-O2", "-ffp-contract=off"),
    module("_trees", "-O3"),
    module("_dlrm", "-O3", "-Wno-psabi"),
    module("_tables", "-O2", *(["-DENSEMBLE_URING"] if URING else []), *(["-DENSEMBLE_HIREDIS"] if HIREDIS else []),
           libraries=["z", *(["uring"] if URING else []), *(["hiredis"] if HIREDIS else [])]),
]
if OPENVINO_C:
    MODULES.append(module("_openvino", "-O2", include=(str(OPENVINO / "include"),),
                          extra_link_args=[str(OPENVINO_C[-1]), "-Wl,-rpath,$ORIGIN/../../openvino/libs",
                                           f"-Wl,-rpath,{OPENVINO / 'libs'}"]))
if numpy is not None:
    MODULES.append(module("_chain", "-O2", "-ffp-contract=off", include=(numpy.get_include(),)))
# The backend: its entry points, the embedded interpreter, the C path, its statistics and what they all use
# of Triton (backend_internal.h).
BACKEND = Extension(
    "ensemble.native.libtriton_native",
    [f"{NATIVE}/backend{part}.c" for part in ("", "_interpreter", "_plain", "_statistics", "_io", "_shadow", "_tables", "_built")],
    optional=not STRICT,
    depends=[f"{NATIVE}/{h}" for h in ("backend_internal.h", "triton_api.h", "backend_checks.h")] + API,
    include_dirs=[NATIVE], define_macros=[("PYTHON_LIBRARY", f'"{PYTHON_LIBRARY}"')],
    libraries=[f"python{LIBRARY_NAME}"], library_dirs=[sysconfig.get_config_var("LIBDIR") or ""],
    extra_compile_args=[*WARNINGS, "-O2", "-fvisibility=hidden"])



class BuildExt(build_ext):
    """setuptools' build, with a module that could not be built named on stderr in one line (pip shows
    it with -v; ``python -m ensemble.native`` says it after any install)."""

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:
            print(f"ensemble: the C module {ext.name} was not built ({exc}); its slower path will serve",
                  file=sys.stderr)
            raise


setup(ext_modules=[*MODULES, BACKEND], cmdclass={"build_ext": BuildExt})
