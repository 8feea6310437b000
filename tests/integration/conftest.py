"""Real tritonservers on free ports, one per layout, started once per session on first use; a
server's log is printed if it dies.

The suite runs keyed servers, as every exposed deployment does: the session's servers (and the
tests' own, through :data:`tests.helpers.ADMIN_KEY`) put Triton's restricted APIs behind a key, and
``ENSEMBLE_ADMIN_KEY`` holds it for the whole session, so deploy, rollback, the supervisor and the
``ensemble`` commands the tests run send it as an operator's would."""

from __future__ import annotations

import os

import pytest

from ensemble.models.registry import Layout
from ensemble.operate.monitoring import LatencySummaries
from ensemble.operate.control import ADMIN_KEY_ENV
from ensemble.operate.server import DEFAULT_LAYOUT, ServerOptions, TritonServer
from ensemble.base.machine import free_port
from tests.helpers import ADMIN_KEY

CPU_LAYOUTS = (Layout.FUSED, Layout.NATIVE)


@pytest.fixture(scope="session", autouse=True)
def admin_key():
    """The key of every server the suite starts, in the operator's variable for the whole session."""
    before = os.environ.get(ADMIN_KEY_ENV)
    os.environ[ADMIN_KEY_ENV] = ADMIN_KEY
    yield ADMIN_KEY
    if before is None:
        os.environ.pop(ADMIN_KEY_ENV, None)
    else:
        os.environ[ADMIN_KEY_ENV] = before


@pytest.fixture(scope="session")
def servers(trained, tmp_path_factory):
    """``servers(layout)`` -> a running server of that layout (started on first call), with the
    latency summaries on, as the deployments that ship the dashboard run it (test_metrics.py
    checks every metric the dashboard reads; test_serve_cli.py the default, without them)."""
    started: dict[Layout, TritonServer] = {}

    def get(layout: Layout) -> TritonServer:
        if layout not in started:
            log = tmp_path_factory.mktemp(f"server-{layout.value}") / "tritonserver.log"
            srv = TritonServer(ServerOptions(trained.repository, http_port=free_port(), grpc_port=free_port(),
                                             metrics_port=free_port(), log_file=log, layout=layout,
                                             latency_summaries=LatencySummaries(True), admin_key=ADMIN_KEY))
            srv.start()  # raises ServerError with the log tail if it cannot start
            started[layout] = srv
        return started[layout]

    yield get
    died = [layout for layout, srv in started.items() if not srv.alive()]
    tails = {layout: started[layout].log_tail(80) for layout in died}
    for srv in started.values():
        srv.stop()
    if died:
        pytest.fail("tritonserver died during the session:\n" +
                    "\n".join(f"[{layout.value}]\n{tails[layout]}" for layout in died))


@pytest.fixture(scope="session")
def server(servers):
    """The server `ensemble serve` runs by default."""
    return servers(DEFAULT_LAYOUT)


@pytest.fixture(scope="session")
def fused_server(servers):
    """The python-backend layout: the ranker and `rank` each in a stub process beside Triton's."""
    return servers(Layout.FUSED)


@pytest.fixture(scope="session", params=CPU_LAYOUTS, ids=lambda layout: layout.value)
def layout_server(request, servers):
    """Each CPU layout in turn (tests that every layout must pass)."""
    return servers(request.param)


@pytest.fixture(autouse=True)
def _server_still_up(request):
    yield
    for name in ("server", "fused_server", "layout_server"):
        if name in request.fixturenames:
            srv = request.getfixturevalue(name)
            assert srv.alive() and srv.ready(), f"server stopped serving:\n{srv.log_tail(80)}"


@pytest.fixture(scope="session")
def http_client(server):
    from clients.triton import RankerClient

    return RankerClient(server.http_url, "http")


@pytest.fixture(scope="session")
def grpc_client(server):
    from clients.triton import RankerClient

    return RankerClient(server.grpc_url, "grpc")
