"""The supervisor's decisions, with stand-ins for tritonserver: ``sleep`` processes for its process
and its backend processes, a silent socket for a server that never answers, recorders for probes and
actions (what is stubbed and why: docs/development.md, "Set-up and tests"). The faults themselves are
injected into a real server in tests/integration/test_faults.py."""

import pytest

from ensemble.models.registry import Layout
from ensemble.operate.server import ServerOptions, TritonServer
from ensemble.operate.supervise import GaveUp, Supervisor, SupervisorPolicy
from tests.helpers import stop_process


def _server(tmp_path) -> TritonServer:
    log = tmp_path / "tritonserver.log"
    log.write_text("I1122 12:00:00.000 1 server.cc:1] starting\n"
                   "E1122 12:00:01.000 1 server.cc:2] failed to load 'ranker': the real cause\n")
    # the fused layout: its ranker and rank model are python-backend processes the supervisor ends
    return TritonServer(ServerOptions(tmp_path, log_file=log, layout=Layout.FUSED))


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


class _Stubs:
    """Stands in for the server's backend processes: ``sleep`` processes, one per model."""

    def __init__(self, *models: str):
        import subprocess

        self.procs = {m: subprocess.Popen(["sleep", "60"]) for m in models}

    def pids(self) -> dict[str, int]:
        return {m: p.pid for m, p in self.procs.items() if p.poll() is None}

    def close(self) -> None:
        for p in self.procs.values():
            p.kill()
            p.wait()


def _supervised_stubs(tmp_path, monkeypatch, *models):
    server = _server(tmp_path)
    stubs = _Stubs(*models)
    monkeypatch.setattr(server, "alive", lambda: True)
    monkeypatch.setattr(server, "stub_pids", stubs.pids)
    lines: list[str] = []
    supervisor = Supervisor(server, SupervisorPolicy(stop_confirm=0.05), log=lines.append)
    reloads: list[bool] = []
    monkeypatch.setattr(supervisor, "reload_ranker", lambda unload_first=False, **_: reloads.append(unload_first))
    return supervisor, stubs, lines, reloads


def test_a_stopped_ranker_process_is_ended_and_healed_before_any_probe(tmp_path, monkeypatch):
    """A SIGSTOPped backend process must be ended before it can resume: Triton 2.51 gives up on it
    after a second and crashes when it resumes (module docstring), so no probe is waited for."""
    import signal

    supervisor, stubs, lines, reloads = _supervised_stubs(tmp_path, monkeypatch, "ranker", "rank")
    monkeypatch.setattr(supervisor, "probe", lambda: pytest.fail("probed a stopped ranker"))
    try:
        stop_process(stubs.procs["ranker"].pid)
        supervisor.check()
        assert stubs.procs["ranker"].wait(5) == -signal.SIGKILL
        assert stubs.procs["rank"].poll() is None  # the rank model's process is not the ranker's
        assert reloads == [True] and "stopped" in lines[0], lines
    finally:
        stubs.close()


def test_a_stop_shorter_than_stop_confirm_is_left_alone(tmp_path, monkeypatch):
    from ensemble.operate import processes

    supervisor, stubs, lines, reloads = _supervised_stubs(tmp_path, monkeypatch, "ranker")
    states = iter(["T", "S"])  # stopped at the first look, running again at the second (a profiler's sample)
    monkeypatch.setattr(processes, "stat_fields", lambda pid: [next(states, "S")])
    monkeypatch.setattr(supervisor, "probe", lambda: None)
    monkeypatch.setattr(supervisor, "_check_rank", lambda: None)
    supervisor._config = {}
    try:
        supervisor.check()
        assert stubs.procs["ranker"].poll() is None and reloads == [] and lines == []
    finally:
        stubs.close()


def test_a_stopped_rank_process_is_healed_and_the_ranker_left_alone(tmp_path, monkeypatch):
    supervisor, stubs, lines, reloads = _supervised_stubs(tmp_path, monkeypatch, "ranker", "rank")
    healed: list[str] = []
    monkeypatch.setattr(supervisor, "probe", lambda: None)
    monkeypatch.setattr(supervisor, "probe_rank", lambda: pytest.fail("probed a stopped rank model"))
    monkeypatch.setattr(supervisor, "heal_rank", healed.append)
    supervisor._config = {}
    try:
        stop_process(stubs.procs["rank"].pid)
        supervisor.check()
        assert len(healed) == 1 and "stopped" in healed[0], healed
        assert reloads == [] and stubs.procs["ranker"].poll() is None
    finally:
        stubs.close()


def test_a_rank_answer_naming_the_rankers_process_heals_the_ranker_not_rank(tmp_path, monkeypatch):
    """rank calls the ranker: when the ranker's process stalls between the ranker's probe and
    rank's, rank answers with the ranker's broken-stub error. The ranker's process is the one to end."""
    supervisor, stubs, lines, reloads = _supervised_stubs(tmp_path, monkeypatch, "ranker", "rank")
    monkeypatch.setattr(supervisor, "probe", lambda: None)
    monkeypatch.setattr(supervisor, "probe_rank",
                        lambda: '{"error":"ranker: Stub process \'ranker_0_0\' is not healthy."}')
    monkeypatch.setattr(supervisor, "heal_rank", lambda problem: pytest.fail("healed rank for the ranker's fault"))
    supervisor._config = {}
    try:
        supervisor.check()
        assert stubs.procs["ranker"].wait(5) == -9 and stubs.procs["rank"].poll() is None
        assert reloads == [True], lines
    finally:
        stubs.close()


@pytest.mark.parametrize("layout", [Layout.NATIVE, Layout.FUSED])
def test_refusals_heal_only_after_nothing_was_scored_for_the_stall_window(tmp_path, monkeypatch, layout):
    """Probes refused by the ranker's admission while nothing is scored: overload on a starved server
    for up to ``refusing_stall`` seconds, a wedged ranker after it (the native layout restarts the server)."""
    server = TritonServer(ServerOptions(tmp_path, log_file=tmp_path / "log", layout=layout))
    monkeypatch.setattr(server, "alive", lambda: True)
    now = [0.0]
    acted: list[str] = []
    supervisor = Supervisor(server, SupervisorPolicy(refusing_stall=5.0), log=lambda _: None, clock=lambda: now[0])
    monkeypatch.setattr(supervisor, "probe", lambda: 'HTTP 503: {"error":"refused: the ranker is at capacity"}')
    monkeypatch.setattr(supervisor, "_progressing", lambda: False)
    monkeypatch.setattr(supervisor, "_stopped_ranker_stubs", lambda: {})
    monkeypatch.setattr(supervisor, "restart", lambda: acted.append("restart"))
    monkeypatch.setattr(supervisor, "_heal", lambda problem, models=None: acted.append("heal"))
    for t in (0.0, 1.0, 2.0, 3.0, 4.0, 4.9):
        now[0] = t
        supervisor.check()
    assert acted == []
    for t in (5.0, 6.0):
        now[0] = t
        supervisor.check()
    assert acted == ["restart" if layout is Layout.NATIVE else "heal"]
    # a probe that is not a refusal (no answer) keeps the two-strike rule
    acted.clear()
    supervisor._failures, supervisor._refusing_since = 0, None
    monkeypatch.setattr(supervisor, "probe", lambda: "TimeoutError: timed out")
    for t in (10.0, 11.0):
        now[0] = t
        supervisor.check()
    assert len(acted) == 1


def test_a_server_that_answers_nothing_is_restarted_after_two_probe_timeouts(tmp_path, monkeypatch):
    """Every question the supervisor asks (the probe, then the success count that tells overload
    from a fault) waits no longer than the probe timeout: a stopped or hung server used to hold the
    success count for 10 s per failed probe. Here a socket that accepts and never answers."""
    import socket
    import time

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        server = TritonServer(ServerOptions(tmp_path, http_port=silent.getsockname()[1], log_file=tmp_path / "log",
                                            layout=Layout.NATIVE))
        monkeypatch.setattr(server, "alive", lambda: True)
        supervisor = Supervisor(server, SupervisorPolicy(probe_timeout=0.2), log=lambda _: None)
        supervisor._body = b"{}"  # the probe's body is sized from the served config, which nothing answers
        acted: list[str] = []
        monkeypatch.setattr(supervisor, "restart", lambda: acted.append("restart"))
        started = time.monotonic()
        supervisor.check()
        assert acted == []  # one unanswered probe is not yet a fault
        supervisor.check()
        took = time.monotonic() - started
    assert acted == ["restart"]
    assert took < 5.0, took  # two probes and two success counts at 0.2 s each; 20 s with the 10 s default


@pytest.mark.parametrize("layout", [Layout.NATIVE, Layout.FUSED])
def test_a_stopped_server_is_restarted_before_any_probe(tmp_path, monkeypatch, layout):
    """A stopped tritonserver answers nothing: it is restarted at once, in any layout, without
    waiting for probes and questions to time out."""
    import subprocess

    server = TritonServer(ServerOptions(tmp_path, log_file=tmp_path / "log", layout=layout))
    server.process = subprocess.Popen(["sleep", "60"])  # stands in for tritonserver's process
    try:
        acted: list[str] = []
        supervisor = Supervisor(server, SupervisorPolicy(stop_confirm=0.05), log=acted.append)
        monkeypatch.setattr(supervisor, "probe", lambda: acted.append("probed"))
        monkeypatch.setattr(supervisor, "restart", lambda: acted.append("restart"))
        stop_process(server.process.pid)
        supervisor.check()
        assert acted == [f"tritonserver {server.process.pid} is stopped: restarting it", "restart"]
    finally:
        server.process.kill()
        server.process.wait()
