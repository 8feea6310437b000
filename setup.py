"""Only for the compiled parts; everything else is in pyproject.toml.

- ``ensemble.serving._native``: the request path's per-string loops, a Python extension.
  ``optional=True``: without a C compiler or Python headers the install still succeeds and
  ``ensemble.serving.native`` uses its Python loops (slower, same results).
- ``ensemble.models._trees``: the boosted trees as arrays, evaluated tree-major over a batch
  (``ensemble.models.xgb.TreeArrays``); optional like the above (then the TL2cgen library and
  XGBoost score the trees).
- ``ensemble.models._dlrm``: either DLRM's forward pass in one C call (``ensemble.models.dlrm_kernel``);
  optional (then TorchScript and LiteRT score the DLRMs).
- ``ensemble/serving/libtriton_fused*.so``: the ``native`` layout's Triton backend
  (``ensemble/serving/fused_backend.c``). Not a Python module: Triton loads it into its own process and it
  embeds this interpreter's libpython, so it links that library. ``optional=True`` as well: without it
  the ``fused`` and ``ensemble`` layouts still serve (``ensemble serve --layout native`` says why it cannot).
"""

import sysconfig

from setuptools import Extension, setup

PYTHON_LIBRARY = sysconfig.get_config_var("INSTSONAME") or "libpython3.11.so.1.0"
LIBRARY_NAME = sysconfig.get_config_var("LDVERSION") or "3.11"

setup(ext_modules=[
    Extension("ensemble.serving._native", ["ensemble/serving/_native.c"], optional=True,
              extra_compile_args=["-O2"]),
    Extension("ensemble.models._trees", ["ensemble/models/_trees.c"], optional=True, extra_compile_args=["-O3"]),
    Extension("ensemble.models._dlrm", ["ensemble/models/_dlrm.c"], optional=True,
              extra_compile_args=["-O3", "-Wno-psabi"]),
    Extension("ensemble.serving.libtriton_fused", ["ensemble/serving/fused_backend.c"],
              optional=True, depends=["ensemble/serving/triton_api.h"],
              define_macros=[("PYTHON_LIBRARY", f'"{PYTHON_LIBRARY}"')],
              libraries=[f"python{LIBRARY_NAME}"], library_dirs=[sysconfig.get_config_var("LIBDIR") or ""],
              extra_compile_args=["-O2", "-fvisibility=hidden"]),
])
