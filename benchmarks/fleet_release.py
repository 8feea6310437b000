"""A fleet under load while a replica dies and a release goes out through the gateway.

Not a test: prints a table and writes ``<out>/fleet-release.json`` (machine, command, events,
per-client and per-replica counts). What it runs, on loopback:

1. A private copy of ``--repository`` with one more release exported from ``--workdir`` (the
   release to deploy); the copy declares its previous newest release, which the fleet serves first.
2. ``ensemble serve --replicas N`` on it (N tritonservers, each supervised, behind Envoy).
3. ``--clients`` plain tritonclient clients (half HTTP, half gRPC, no retries), each sending 1-row
   requests one at a time with a pause between them (bounded load, not overload), recording every
   answer's ``model_version`` and every failure.
4. At ``--kill-at`` seconds one replica's tritonserver is SIGKILLed; at ``--deploy-at`` ``ensemble
   deploy --url GATEWAY`` runs; at ``--kill-again-at`` another replica is SIGKILLed (it must come
   back serving the new release).

The targets (issue "Past one machine"): 0 failed requests; 0 answers from an older release after
a newer one on any client; a killed replica back, serving the current release and in the gateway's
rotation within 10 s; each
replica's share of requests within +-15% of the mean, counted by the gateway over the last
``--share-window`` seconds (all replicas live). Usage (after ``make demo``)::

    .venv/bin/python -m benchmarks.fleet_release --repository model_repository --workdir build
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


from benchmarks.fleet_setup import private_repository, serve_fleet
from benchmarks.gateway_overhead import one_row_inputs
from ensemble import schema
from ensemble.base.machine import summary

RECOVERY_TARGET_S = 10.0
SHARE_TOLERANCE = 0.15


class Client(threading.Thread):
    """One client: sequential 1-row requests, no retries; ``answers`` holds (time, version or None)."""

    def __init__(self, index: int, protocol: str, address: str, pause: float, stop: threading.Event):
        super().__init__(daemon=True, name=f"client-{index}")
        self.index, self.protocol, self.address, self.pause, self.stop = index, protocol, address, pause, stop
        self.answers: list[tuple[float, int | None]] = []
        self.errors: list[str] = []

    def run(self) -> None:
        import tritonclient.grpc as grpcclient
        import tritonclient.http as httpclient

        module = httpclient if self.protocol == "http" else grpcclient
        client = module.InferenceServerClient(self.address)
        inputs = one_row_inputs(module, self.index)
        while not self.stop.is_set():
            try:
                reply = client.infer(schema.Model.RANKER.value, inputs)
                response = reply.get_response()
                version = response["model_version"] if self.protocol == "http" else response.model_version
                self.answers.append((time.monotonic(), int(version)))
            except Exception as exc:  # noqa: BLE001 - every failure counts
                self.answers.append((time.monotonic(), None))
                self.errors.append(f"{type(exc).__name__}: {exc}"[:300])
            time.sleep(self.pause)
        client.close()

    def backwards(self) -> int:
        """Answers from an older release than one this client had already been answered by."""
        newest, count = 0, 0
        for _, version in self.answers:
            if version is None:
                continue
            count += version < newest
            newest = max(newest, version)
        return count


def _tritonserver_pid(http_port: int) -> int | None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"tritonserver") and f"--http-port={http_port}".encode() in argv:
            return int(entry.name)
    return None


def _recovery(control, release: int, killed_at: float, timeout: float = 60.0) -> float | None:
    """Seconds from the kill until the replica reports ``release`` ready (and only releases
    at least that new), or None after ``timeout``."""
    from ensemble.operate.control import ControlError

    while time.monotonic() - killed_at < timeout:
        try:
            versions = control.ready_versions()
            if release in versions and min(versions) >= release:
                return time.monotonic() - killed_at
        except ControlError:
            pass
        time.sleep(0.05)
    return None


def _in_rotation(admin_url: str, replica, killed_at: float, timeout: float = 60.0) -> float | None:
    """Seconds from the kill until the gateway routes to the replica again (both its ports healthy)."""
    import urllib.request

    wanted = {f"{replica.host}:{replica.http_port}", f"{replica.host}:{replica.grpc_port}"}
    while time.monotonic() - killed_at < timeout:
        with urllib.request.urlopen(f"{admin_url}/clusters", timeout=5) as reply:
            lines = reply.read().decode().splitlines()
        flags = [line.rsplit("::", 1)[1] for line in lines
                 if line.startswith(("replicas_http::", "replicas_grpc::")) and "::health_flags::" in line
                 and line.split("::")[1] in wanted]
        if flags and all(f == "healthy" for f in flags):
            return time.monotonic() - killed_at
        time.sleep(0.05)
    return None


def _host_totals(admin_url: str, ports: dict[int, int]) -> dict[int, int]:
    """Requests the gateway has sent to each replica (HTTP and gRPC clusters), by replica index."""
    import urllib.request

    with urllib.request.urlopen(f"{admin_url}/clusters", timeout=5) as reply:
        text = reply.read().decode()
    totals = {i: 0 for i in set(ports.values())}
    for line in text.splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] in ("replicas_http", "replicas_grpc") and parts[2] == "rq_total":
            port = int(parts[1].rsplit(":", 1)[1])
            if port in ports:
                totals[ports[port]] += int(parts[3])
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repository", default="model_repository")
    parser.add_argument("--workdir", default="build", help="what `ensemble train` left (the new release's export)")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--pause", type=float, default=0.005, help="seconds each client waits between requests")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--kill-at", type=float, default=12.0)
    parser.add_argument("--deploy-at", type=float, default=25.0)
    parser.add_argument("--kill-again-at", type=float, default=38.0)
    parser.add_argument("--share-window", type=float, default=10.0)
    parser.add_argument("--out", default="docs/results")
    args = parser.parse_args(argv)

    from ensemble.repository import declared

    scratch, repository, (new,) = private_repository(args.repository, [args.workdir], "fleet-release-")
    serving = declared.read(repository)
    served = serve_fleet(repository, args.replicas, scratch)
    serve, http_port, grpc_port, env = served.process, served.http_port, served.grpc_port, served.env
    ensemble = str(Path(sys.executable).parent / "ensemble")
    fleet = served.record()
    if fleet is None:
        print("\n".join(served.log[-30:]), file=sys.stderr)
        serve.kill()
        return 1
    controls = fleet.replicas()
    ports = {p: i for i, r in enumerate(fleet.gateway.replicas) for p in (r.http_port, r.grpc_port)}
    stop = threading.Event()
    clients = [Client(i, "http" if i % 2 == 0 else "grpc",
                      f"127.0.0.1:{http_port if i % 2 == 0 else grpc_port}", args.pause, stop)
               for i in range(args.clients)]
    events: list[dict] = []
    totals: list[tuple[float, dict[int, int]]] = []
    start = time.monotonic()
    for client in clients:
        client.start()

    def at(seconds: float) -> None:
        while time.monotonic() - start < seconds:
            totals.append((time.monotonic() - start, _host_totals(fleet.admin_url, ports)))
            time.sleep(0.5)

    def kill(index: int, release: int) -> None:
        pid = _tritonserver_pid(fleet.gateway.replicas[index].http_port)
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        recovered = _recovery(controls[index], release, killed_at)
        routed = _in_rotation(fleet.admin_url, fleet.gateway.replicas[index], killed_at) if recovered else None
        events.append({"event": f"SIGKILL replica {index}", "at_s": round(killed_at - start, 2),
                       "serving_release_again_after_s": None if recovered is None else round(recovered, 2),
                       "in_rotation_again_after_s": None if routed is None else round(routed, 2),
                       "release_expected": release})

    try:
        at(args.kill_at)
        threading.Thread(target=kill, args=(1, serving), daemon=True).start()
        at(args.deploy_at)
        began = time.monotonic()
        done = subprocess.run([ensemble, "deploy", "--url", f"127.0.0.1:{http_port}"], capture_output=True,
                              text=True, env=env)
        events.append({"event": f"ensemble deploy --url GATEWAY (release {serving} -> {new})",
                       "at_s": round(began - start, 2), "took_s": round(time.monotonic() - began, 2),
                       "exit_code": done.returncode, "output": (done.stdout + done.stderr).strip().splitlines()[-8:]})
        at(args.kill_again_at)
        threading.Thread(target=kill, args=(2 % args.replicas, new), daemon=True).start()
        at(args.seconds)
    finally:
        stop.set()
        for client in clients:
            client.join(timeout=10)
        serve.send_signal(signal.SIGINT)
        try:
            serve.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)

    window_start = args.seconds - args.share_window
    first = next(t for t in totals if t[0] >= window_start)
    last = totals[-1]
    window = {i: last[1][i] - first[1][i] for i in last[1]}
    mean = sum(window.values()) / len(window)
    shares = {i: round(n / mean - 1, 3) for i, n in window.items()}
    rows = [{"client": c.index, "protocol": c.protocol, "answers": sum(v is not None for _, v in c.answers),
             "failed": len(c.errors), "backwards": c.backwards(),
             "versions": sorted({v for _, v in c.answers if v is not None}), "first_errors": c.errors[:3]}
            for c in clients]
    recoveries = [e["in_rotation_again_after_s"] for e in events if "in_rotation_again_after_s" in e]
    result = {
        "benchmark": "fleet_release", "machine": summary(), "command": "python -m benchmarks.fleet_release " +
        " ".join(argv if argv is not None else sys.argv[1:]),
        "replicas": args.replicas, "clients": args.clients, "seconds": args.seconds, "releases": [serving, new],
        "events": events, "per_client": rows,
        "share_window_s": [round(first[0], 1), round(last[0], 1)], "requests_per_replica_in_window": window,
        "share_vs_mean": shares,
        "targets": {
            "failed_requests": sum(r["failed"] for r in rows),
            "answers_from_older_release_after_newer": sum(r["backwards"] for r in rows),
            "recovery_s_max": max((r for r in recoveries if r is not None), default=None),
            "recovered_all": all(r is not None and r <= RECOVERY_TARGET_S for r in recoveries),
            "share_within_15pct": all(abs(v) <= SHARE_TOLERANCE for v in shares.values()),
            "deploy_exit_code": next((e["exit_code"] for e in events if "exit_code" in e), None)},
    }
    print(f"fleet of {args.replicas} replicas, {args.clients} clients, {args.seconds:.0f}s; releases {serving} -> {new}")
    print("| client | protocol | answers | failed | older after newer | releases seen |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['client']} | {r['protocol']} | {r['answers']} | {r['failed']} | {r['backwards']} | {r['versions']} |")
    for e in events:
        print(f"- {e['event']} at {e['at_s']}s: " + ", ".join(f"{k} {v}" for k, v in e.items()
                                                             if k not in ("event", "at_s", "output")))
    print(f"- requests per replica, last {args.share_window:.0f}s: {window}; vs mean {shares}")
    print(f"- targets: {result['targets']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fleet-release.json").write_text(json.dumps(result, indent=1) + "\n")
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
