"""One real tritonserver per test session, on free ports; its log is printed if it dies."""

from __future__ import annotations

import pytest

from ensemble.serve import ServerOptions, TritonServer, free_port


@pytest.fixture(scope="session")
def server(trained, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "tritonserver.log"
    options = ServerOptions(trained.repository, http_port=free_port(), grpc_port=free_port(),
                            metrics_port=free_port(), log_file=log)
    srv = TritonServer(options)
    srv.start()  # raises ServerError with the log tail if it cannot start
    yield srv
    alive = srv.alive()
    srv.stop()
    if not alive:
        pytest.fail(f"tritonserver died during the session:\n{srv.log_tail(80)}")


@pytest.fixture(autouse=True)
def _server_still_up(request):
    yield
    if "server" in request.fixturenames:
        srv = request.getfixturevalue("server")
        assert srv.alive() and srv.ready(), f"server stopped serving:\n{srv.log_tail(80)}"


@pytest.fixture(scope="session")
def http_client(server):
    from clients.triton import RankerClient

    return RankerClient(server.http_url, "http")


@pytest.fixture(scope="session")
def grpc_client(server):
    from clients.triton import RankerClient

    return RankerClient(server.grpc_url, "grpc")
