# syntax=docker/dockerfile:1
# Trains on the GPU (--device gpu) and exports into the model repository volume.
# torch==2.13.0 from the package index is the CUDA build on Linux x86_64; xgboost and
# tensorflow[and-cuda] replace the CPU-only xgboost-cpu and tensorflow-cpu wheels.
FROM python:3.11-slim-bookworm

# Debian's package versions move with security updates; pinning them (DL3008) would break
# rebuilds, so the release (bookworm) is the pin.
# gcc + libc6-dev: `ensemble export` compiles the trees to native code (TL2cgen).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

ENV ENSEMBLE_CACHE_DIR=/opt/ensemble-cache \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/ensemble
COPY requirements.txt pyproject.toml setup.py ./

# pip < 26: pip 26 refuses the merlin 23.8 sdists from the index (see shared ARCHITECTURE notes).
RUN python -m pip install --no-cache-dir "pip<26" \
    && sed -E 's/^(xgboost|tensorflow)-cpu==/\1==/' requirements.txt > /tmp/requirements-gpu.txt \
    && python -m pip install --no-cache-dir -r /tmp/requirements-gpu.txt

COPY ensemble ./ensemble
COPY clients ./clients
COPY loadtest ./loadtest
ENV PYTHONPATH=/opt/ensemble
# The gpu extra (pyproject.toml) on top of the same pins; then the Treelite of the pinned FIL
# backend for `ensemble check`, so the check runs offline in the container.
RUN python -m pip install --no-cache-dir -r /tmp/requirements-gpu.txt ".[gpu]" \
    && python -c "from ensemble.check.loading import ensure_treelite; from ensemble.repository.releases import PINNED; ensure_treelite(PINNED.treelite)"

ENTRYPOINT ["ensemble"]
