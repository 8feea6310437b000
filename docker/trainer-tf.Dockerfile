# syntax=docker/dockerfile:1
# GPU trainer, second stage: trains the Keras DLRM on the GPU (tensorflow[and-cuda], CUDA 12
# wheels) on the workflow the first stage fitted (docker/trainer.Dockerfile), fits the blend,
# exports the repository and runs `ensemble check --target gpu`. torch is the CPU-only wheel
# (export and the check read TorchScript; no CUDA 13 libraries next to TensorFlow's CUDA 12 ones).
FROM python:3.11-slim-bookworm

# Debian's package versions move with security updates; pinning them (DL3008) would break
# rebuilds, so the release (bookworm) is the pin.
# gcc + libc6-dev: `ensemble export` compiles the trees to native code (TL2cgen).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# PyTorch's own index of CPU-only wheels (torch==X+cpu); the package index only has CUDA builds.
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ENV ENSEMBLE_CACHE_DIR=/opt/ensemble-cache \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/ensemble
COPY requirements.txt pyproject.toml setup.py ./
COPY docker/check_install.py /usr/local/bin/check_install.py

# The CPU torch first: requirements.txt's torch==2.13.0 is then already satisfied by 2.13.0+cpu.
# pip < 26: pip 26 refuses the merlin 23.8 sdists from the index (see shared ARCHITECTURE notes).
RUN python -m pip install --no-cache-dir "pip<26" \
    && python -m pip install --no-cache-dir --index-url "${TORCH_CPU_INDEX}" \
       "$(grep -E '^torch==' requirements.txt)+cpu" \
    && sed -E 's/^tensorflow-cpu==/tensorflow[and-cuda]==/' requirements.txt > /tmp/requirements-tf.txt \
    && python -m pip install --no-cache-dir -r /tmp/requirements-tf.txt \
    && python /usr/local/bin/check_install.py --torch cpu

COPY ensemble ./ensemble
COPY clients ./clients
COPY loadtest ./loadtest
ENV PYTHONPATH=/opt/ensemble
# Then the Treelite of the pinned FIL backend for `ensemble check`, so the check runs offline.
RUN python -m pip install --no-cache-dir --no-deps . \
    && python /usr/local/bin/check_install.py --torch cpu \
    && python -c "from ensemble.check.loading import ensure_treelite; from ensemble.models.triton_releases import PINNED; ensure_treelite(PINNED.treelite)"

ENTRYPOINT ["ensemble"]
