"""Only for the compiled parts; everything else is in pyproject.toml.

- ``ensemble.serving._native``: the request path's per-string loops, a Python extension.
  ``optional=True``: without a C compiler or Python headers the install still succeeds and
  ``ensemble.serving.native`` uses its Python loops (slower, same results).
- ``ensemble.models._trees``: the boosted trees as arrays, evaluated tree-major over a batch
  (``ensemble.models.xgb.TreeArrays``); optional like the above (then the TL2cgen library and
  XGBoost score the trees).
- ``ensemble.models._dlrm``: either DLRM's forward pass in one C call (``ensemble.models.dlrm_kernel``);
  optional (then TorchScript and LiteRT score the DLRMs).
- ``ensemble.serving._admission``: the ranker's admission policy in C (``ensemble.serving.admission``
  keeps the Python one, which serves without it); ``ensemble.serving._chain``: the whole chain in C
  over the modules above (needs numpy's headers: left out of an isolated build). With both, the
  native backend plans and scores a call without Python; without them it calls the Python path.
  The modules hand each other their C entry points as capsules (``ensemble/kernel_api.h``).
- ``ensemble/serving/libtriton_fused*.so``: the ``native`` layout's Triton backend
  (``ensemble/serving/fused_backend.c``). Not a Python module: Triton loads it into its own process and it
  embeds this interpreter's libpython, so it links that library. ``optional=True`` as well: without it
  the ``fused`` and ``ensemble`` layouts still serve (``ensemble serve --layout native`` says why it cannot).
"""

import importlib.util
import sysconfig
from pathlib import Path

from setuptools import Extension, setup

try:  # ensemble.serving._chain reads numpy's ufunc struct (numpy/ufuncobject.h)
    import numpy
except ImportError:  # an isolated build (the images' `pip install .`): built without the chain
    numpy = None

# ensemble.models._openvino links the C runtime the openvino wheel ships (headers and libraries), found
# where that wheel is installed; without it the module is not built and a release that declares OpenVINO
# says so at load (ensemble.models.engines).
_OPENVINO = importlib.util.find_spec("openvino")
OPENVINO = Path(_OPENVINO.origin).parent if _OPENVINO and _OPENVINO.origin else None
OPENVINO_C = sorted((OPENVINO / "libs").glob("libopenvino_c.so.*")) if OPENVINO else []

PYTHON_LIBRARY = sysconfig.get_config_var("INSTSONAME") or "libpython3.11.so.1.0"
LIBRARY_NAME = sysconfig.get_config_var("LDVERSION") or "3.11"
API = ["ensemble/kernel_api.h"]  # the C entry points the modules hand each other
# Every warning is an error. Unused parameters are allowed: Python's and Triton's callback signatures
# (self, kwargs, backend) take arguments a function may not need.
WARNINGS = ["-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter"]

setup(ext_modules=[
    Extension("ensemble.serving._native", ["ensemble/serving/_native.c"], optional=True,
              depends=API, include_dirs=["ensemble"], extra_compile_args=[*WARNINGS, "-O2"]),
    Extension("ensemble.serving._admission", ["ensemble/serving/_admission.c"], optional=True,
              depends=API, include_dirs=["ensemble"], extra_compile_args=[*WARNINGS, "-O2", "-ffp-contract=off"]),
    Extension("ensemble.models._trees", ["ensemble/models/_trees.c"], optional=True,
              depends=API, include_dirs=["ensemble"], extra_compile_args=[*WARNINGS, "-O3"]),
    Extension("ensemble.models._dlrm", ["ensemble/models/_dlrm.c"], optional=True,
              depends=API, include_dirs=["ensemble"], extra_compile_args=[*WARNINGS, "-O3", "-Wno-psabi"]),
    Extension("ensemble.serving.libtriton_fused", ["ensemble/serving/fused_backend.c"],
              optional=True, depends=["ensemble/serving/triton_api.h", "ensemble/serving/backend_checks.h", *API],
              include_dirs=["ensemble"],
              define_macros=[("PYTHON_LIBRARY", f'"{PYTHON_LIBRARY}"')],
              libraries=[f"python{LIBRARY_NAME}"], library_dirs=[sysconfig.get_config_var("LIBDIR") or ""],
              extra_compile_args=[*WARNINGS, "-O2", "-fvisibility=hidden"]),
] + ([Extension("ensemble.models._openvino", ["ensemble/models/_openvino.c"], optional=True, depends=API,
                include_dirs=["ensemble", str(OPENVINO / "include")], extra_compile_args=[*WARNINGS, "-O2"],
                extra_link_args=[str(OPENVINO_C[-1]), f"-Wl,-rpath,{OPENVINO / 'libs'}"])]
       if OPENVINO_C else []) + ([Extension("ensemble.serving._chain", ["ensemble/serving/_chain.c"], optional=True, depends=API,
                include_dirs=["ensemble", numpy.get_include()], extra_compile_args=[*WARNINGS, "-O2", "-ffp-contract=off"])]
       if numpy is not None else []))
