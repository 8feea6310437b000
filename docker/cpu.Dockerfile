# syntax=docker/dockerfile:1
# The embedded CPU configuration (pip tritonserver + python backend), the naive baseline and
# locust, for machines without a GPU. Debian's python3.11 is the interpreter build the CPU path
# was run with: the python backend stub in the nvidia-pytriton wheel embeds libpython3.11, and
# stdlib extension modules of another 3.11 build fail to load inside it (README).
FROM debian:bookworm-slim

# Debian's package versions move with security updates; pinning them (DL3008) would break
# rebuilds, so the release (bookworm) is the pin.
# gcc + libc6-dev: `ensemble export` compiles the trees to native code (TL2cgen).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv libpython3.11 libpython3.11-dev libgomp1 make gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/ensemble
COPY Makefile requirements.txt pyproject.toml setup.py ./
COPY ensemble ./ensemble
COPY clients ./clients
COPY loadtest ./loadtest
# The project's own set-up step: .venv on /usr/bin/python3.11, pinned requirements, the package.
RUN make setup PYTHON_BASE=/usr/bin/python3.11
ENV PATH=/opt/ensemble/.venv/bin:$PATH \
    PYTHONPATH=/opt/ensemble
ENTRYPOINT ["ensemble"]
