"""Only for the C extension; everything else is in pyproject.toml.

``optional=True``: without a C compiler or Python headers the install still succeeds and
``ensemble.serving.native`` uses its Python loops (slower, same results).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("ensemble.serving._native", ["ensemble/serving/_native.c"], optional=True,
                             extra_compile_args=["-O2"])])
