"""A pytest plugin (``-p tests.fuzz.sanitized_server``, after ``-p tests.fuzz.sanitized_modules``): every
tritonserver the tests start runs the sanitized native backend under AddressSanitizer, leaks included.

The package comes from ``$ENSEMBLE_SANITIZED_LIB`` (see sanitized_modules), so ``ensemble export`` copies
that build's ``libtriton_native.so`` into each release (``ensemble.native.backend.library()``), and the
servers' embedded interpreters import the same sanitized modules (``PYTHONPATH``). The test process keeps
the sanitizer options it started with (leaks off: the interpreter's own allocations at exit are not
ours); the ones set here reach only the processes it starts, tritonserver among them
(:mod:`ensemble.operate.server` copies the environment). Their reports go to ``build/sanitize/served``.

Only the native layout loads the backend: a test parametrized with another layout is deselected here.
The servers are told to exit 5 s after SIGTERM at most (``--exit-timeout-secs``): Triton otherwise waits
up to 30 s for clients' open connections after its models unload, and ``TritonServer.stop`` kills it after
20 s, before the leak check at its exit could run. Each server's process id goes to
``build/sanitize/served/started``, so the step can tell one that never reached that check.
"""

import os
from pathlib import Path

from ensemble.native import backend
from ensemble.operate.server import TritonServer
from tests.fuzz.sanitize import SERVED, server_environment

LIB = Path(os.environ["ENSEMBLE_SANITIZED_LIB"]).resolve()

_library = backend.library()
if not _library.resolve().is_relative_to(LIB) or b"__asan_init" not in _library.read_bytes():
    raise ImportError(f"the native backend {_library} is not the sanitized build in {LIB}")
os.environ.update(server_environment(SERVED))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(LIB), os.environ.get("PYTHONPATH")) if p)
_command, _start = TritonServer.command, TritonServer.start


def _started(server: TritonServer) -> TritonServer:
    try:
        return _start(server)
    finally:
        if server.process is not None:
            with open(SERVED / "started", "a") as started:
                started.write(f"{server.process.pid}\n")


TritonServer.command = lambda server, binary, backends: [*_command(server, binary, backends), "--exit-timeout-secs=5"]
TritonServer.start = _started


def pytest_collection_modifyitems(config, items):
    from ensemble.models.registry import Layout

    others = {layout.value for layout in Layout} - {Layout.NATIVE.value}

    def other_layout(item) -> bool:  # a Layout, or its name, among the test's parameters
        params = item.callspec.params.values() if hasattr(item, "callspec") else ()
        return any(isinstance(value, str) and getattr(value, "value", value) in others for value in params)

    deselected = [item for item in items if other_layout(item)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not other_layout(item)]


def pytest_report_header(config):
    return f"tritonserver: the sanitized {_library.name} from {LIB}, leak detection on"
