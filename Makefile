# Two commands: `make demo` and `make test`. Both first bring the Debian packages they need
# (ensemble/base/machine.py lists them: as root with apt-get it installs the missing ones, otherwise it stops
# with the one command that would), then set up .venv (idempotent: the stamp file is newer than
# requirements.txt, pyproject.toml, setup.py and the C sources, so a second run installs nothing; pip
# also compiles the C extensions and the native backend, and `python -m ensemble.native` says which
# were not built).
#
# The venv is built on Debian's /usr/bin/python3.11 when it exists: the python-backend stub that
# ships in the nvidia-pytriton wheel embeds the system libpython3.11, and stdlib extension
# modules of another 3.11 build (e.g. pyenv's _ssl) fail to load inside it.
PYTHON_BASE ?= $(shell test -x /usr/bin/python3.11 && echo /usr/bin/python3.11 || command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: setup demo test sanitize test-all gpu-acceptance clean system-setup system-demo system-test

# The system's Python runs this before .venv exists (the module needs only the standard library).
system-setup system-demo system-test:
	@$(PYTHON_BASE) -m ensemble.base.machine packages --for $(@:system-%=%) --install

setup: system-setup $(STAMP)

$(STAMP): requirements.txt pyproject.toml setup.py $(wildcard ensemble/*.h ensemble/*/*.c ensemble/*/*.h)
	test -x $(BIN)/python || $(PYTHON_BASE) -m venv $(VENV)
	$(BIN)/python -m pip install --disable-pip-version-check -q -r requirements.txt
	$(BIN)/python -m pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
	$(BIN)/python -m ensemble.native
	touch $(STAMP)

demo: system-demo setup
	$(BIN)/ensemble demo $(ARGS)

# pytest exit code 5 means no test was collected: report it as the failure it is. Then `sanitize`.
# (tests/unit/test_c_build.py builds the C with warnings as errors: the project's own check.)
test: system-test setup
	$(BIN)/ruff check ensemble clients loadtest benchmarks tests
	@$(BIN)/python -m pytest tests -q -rs $(ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc
	@$(MAKE) --no-print-directory sanitize

# The C code under AddressSanitizer and UndefinedBehaviorSanitizer: the C paths' unit tests on a
# sanitized build (build/sanitize), every libFuzzer target (clang) for SANITIZE_SECONDS each, then the
# native backend inside the real tritonserver with leak detection on (its integration tests and failing
# allocations); any report fails it (docs/fuzzing.md).
SANITIZE_SECONDS ?= 25
sanitize: system-test setup
	$(BIN)/python -m tests.fuzz.sanitize --seconds $(SANITIZE_SECONDS)

test-all: setup
	$(BIN)/python -m pytest tests -q -rs -m "" $(ARGS)

# The GPU acceptance run (ensemble/cli/acceptance.py, docs/gpu-deployment.md): for a host with NVIDIA
# GPUs, Docker Compose v2 and the NVIDIA Container Toolkit. Never run on this project's machines.
# ARGS="--dry-run" prints the commands it would run.
gpu-acceptance: setup
	$(BIN)/python -m ensemble.cli.acceptance $(ARGS)

clean:
	rm -rf build
