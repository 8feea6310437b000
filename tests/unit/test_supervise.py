"""The supervisor's restart budget (the faults themselves are tested against the real server in
tests/integration/test_faults.py)."""

import pytest

from ensemble.serving.server import ServerOptions, TritonServer
from ensemble.serving.supervise import GaveUp, Supervisor, SupervisorPolicy


def _server(tmp_path) -> TritonServer:
    log = tmp_path / "tritonserver.log"
    log.write_text("I1122 12:00:00.000 1 server.cc:1] starting\n"
                   "E1122 12:00:01.000 1 server.cc:2] failed to load 'ranker': the real cause\n")
    return TritonServer(ServerOptions(tmp_path, log_file=log))


def test_gives_up_with_the_log_tail_when_restarts_exceed_the_budget(tmp_path):
    supervisor = Supervisor(_server(tmp_path), SupervisorPolicy(max_restarts=2, restart_window=60),
                            log=lambda _: None, clock=lambda: 100.0)
    supervisor.restarts = [50.0, 90.0]  # two restarts within the last minute already
    with pytest.raises(GaveUp, match=r"died 3 times within 60s(.|\n)*the real cause"):
        supervisor.restart()


def test_restarts_older_than_the_window_do_not_count(tmp_path):
    supervisor = Supervisor(_server(tmp_path), SupervisorPolicy(max_restarts=0, restart_window=60),
                            log=lambda _: None, clock=lambda: 1000.0)
    supervisor.restarts = [10.0, 20.0]
    with pytest.raises(GaveUp, match="died 1 times"):  # only this one counts, and the budget is 0
        supervisor.restart()
    assert supervisor.restarts == [1000.0]
