# syntax=docker/dockerfile:1
# GPU trainer, first stage: fits the features and trains xgb (XGBoost's CUDA build) and the torch
# DLRM (torch==2.13.0 from the package index: the CUDA 13 build on Linux x86_64) on the GPU.
# The Keras DLRM trains in docker/trainer-tf.Dockerfile: TensorFlow 2.21's CUDA wheels are CUDA 12
# builds (nvidia-*-cu12), torch 2.13's are CUDA 13 builds, and both sets ship libraries under the
# same sonames (libcudnn.so.9, libnccl.so.2); one process cannot load both (docs/gpu-deployment.md).
# TensorFlow here is tensorflow-cpu (requirements.txt): NVTabular imports it, no CUDA with it.
FROM python:3.11-slim-bookworm

# Debian's package versions move with security updates; pinning them (DL3008) would break
# rebuilds, so the release (bookworm) is the pin.
# gcc + libc6-dev: the package's C extension.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

ENV PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/ensemble
COPY requirements.txt pyproject.toml setup.py ./
COPY docker/check_install.py /usr/local/bin/check_install.py

# pip < 26: pip 26 refuses the merlin 23.8 sdists from the index (see shared ARCHITECTURE notes).
# The last command fails the build on clashing files or a CPU torch.
RUN python -m pip install --no-cache-dir "pip<26" \
    && sed -E 's/^xgboost-cpu==/xgboost==/' requirements.txt > /tmp/requirements-torch.txt \
    && python -m pip install --no-cache-dir -r /tmp/requirements-torch.txt \
    && python /usr/local/bin/check_install.py --torch cuda

COPY ensemble ./ensemble
COPY clients ./clients
COPY loadtest ./loadtest
ENV PYTHONPATH=/opt/ensemble
RUN python -m pip install --no-cache-dir --no-deps . \
    && python /usr/local/bin/check_install.py --torch cuda

ENTRYPOINT ["ensemble"]
