# syntax=docker/dockerfile:1
# The embedded CPU configuration (pip tritonserver + python backend), the naive baseline and
# locust, for machines without a GPU. Debian's python3.11 is the interpreter build the CPU path
# was run with: the python backend stub in the nvidia-pytriton wheel embeds libpython3.11, and
# stdlib extension modules of another 3.11 build fail to load inside it (docs/development.md).
FROM debian:bookworm-slim

# Debian's package versions move with security updates; pinning them (DL3008) would break
# rebuilds, so the release (bookworm) is the pin.
# gcc + libc6-dev: `ensemble export` compiles the trees to native code (TL2cgen).
# libtcmalloc-minimal4: the allocator `ensemble serve` preloads into tritonserver (ensemble/operate/allocator.py).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv libpython3.11 libpython3.11-dev libgomp1 make gcc libc6-dev libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/*

# PyTorch's own index of CPU-only wheels (torch==X+cpu): torch from the package index is the CUDA
# build, which pulls gigabytes of nvidia-* wheels into an image that has no GPU.
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/ensemble
COPY Makefile requirements.txt pyproject.toml setup.py ./
COPY docker/check_install.py /usr/local/bin/check_install.py
COPY ensemble ./ensemble
COPY clients ./clients
COPY loadtest ./loadtest
# The project's own set-up step (.venv on /usr/bin/python3.11, pinned requirements, the package),
# on a venv that already holds the CPU torch: requirements.txt's torch==2.13.0 is then satisfied
# by 2.13.0+cpu. The last command fails the build if any CUDA wheel got in.
RUN /usr/bin/python3.11 -m venv .venv \
    && .venv/bin/python -m pip install --no-cache-dir --index-url "${TORCH_CPU_INDEX}" \
       "$(grep -E '^torch==' requirements.txt)+cpu" \
    && make setup PYTHON_BASE=/usr/bin/python3.11 \
    && .venv/bin/python /usr/local/bin/check_install.py --torch cpu --no-cuda-wheels
ENV PATH=/opt/ensemble/.venv/bin:$PATH \
    PYTHONPATH=/opt/ensemble
ENTRYPOINT ["ensemble"]
