# syntax=docker/dockerfile:1
# Triton for the GPU configuration: the pinned NGC release plus this package, installed into the
# Python that the python backend stub runs (for the features and blend steps).
# The release must equal ensemble/models/triton_releases.py PINNED (tests/unit/test_compose.py checks it).
ARG TRITON_RELEASE=25.02
FROM nvcr.io/nvidia/tritonserver:${TRITON_RELEASE}-py3

# The stub (/opt/tritonserver/backends/python/triton_python_backend_stub) embeds the container's
# system python3 (3.12.3 since 24.12). Triton's build.py installs numpy<2 into it and sets
# PIP_BREAK_SYSTEM_PACKAGES=1, so pip installs there directly.
WORKDIR /opt/ensemble
COPY requirements.txt pyproject.toml setup.py ./
COPY ensemble ./ensemble
COPY clients ./clients

# features and blend need numpy and pyarrow only: their pins come from requirements.txt (the one
# place pins live). requires-python (<3.12) is about the training stack (merlin 23.8); the modules
# the python models import are plain Python plus numpy/pyarrow, hence --ignore-requires-python.
# The last line fails the build if a serving module cannot be imported by that Python.
RUN grep -E '^(numpy|pyarrow)==' requirements.txt > /tmp/serving-requirements.txt \
    && python3 -m pip install --no-cache-dir -r /tmp/serving-requirements.txt \
    && python3 -m pip install --no-cache-dir --no-deps --ignore-requires-python . \
    && python3 -c "import ensemble.scoring.pipeline, ensemble.features.transforms, ensemble.models.blend, ensemble.models.xgb, pyarrow.parquet"

WORKDIR /opt/tritonserver
