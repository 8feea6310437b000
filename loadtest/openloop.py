"""Open-loop load: requests leave at a fixed rate whatever the server answers.

A closed loop (locust, wrk: N users, each waiting for its answer before the next request) slows
down with the server, so it never offers more load than the server takes and cannot show what
overload does. Here request ``i`` leaves at ``start + i / rate`` on its own connection from a
keep-alive pool (a new connection when none is idle), and each answer is timed from the moment
the request was due, so a late generator counts against the server's latency, not for it.

Requests are Triton v2 JSON bodies for the ranker, built before the run; the HTTP/1.1 client is a
few lines over asyncio streams (aiohttp or tritonclient cost a core at these rates on 2 cores).
``python -m loadtest.openloop --url 127.0.0.1:8000`` measures capacity, then drives twice that.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from ensemble import schema
from loadtest.statistics import percentile

# Answers a client should retry elsewhere or later: the server refused the request (full queue,
# queue deadline passed, model reloading), it did not fail on it.
RETRYABLE = (429, 503, 504)
UNSENT = -1  # Outcome.status of a request the generator did not send (its own bound)


@dataclass(frozen=True)
class Outcome:
    """One request: HTTP status (0: no answer), seconds from when it was due to its answer, body."""

    status: int
    latency: float
    body: bytes = b""
    late: float = 0.0  # how long after it was due the generator sent it


@dataclass
class OpenLoopResult:
    """What one open-loop run saw.

    Attributes:
        rate: offered requests per second; seconds: how long they were offered.
        sent: requests sent; unsent: requests the generator could not send on time (more than
            its bound were unanswered: the generator, not the server, fell behind);
        accepted: answered 200; refused: answered with a retryable status;
        errors: anything else (other statuses, resets, no answer within the timeout).
        late_p99_ms: how late the generator sent requests (p99); when it is not small, the
            generator (sharing the machine) could not keep the rate, and latencies include that.
        accepted_p50_ms / accepted_p99_ms: latency of the accepted requests.
        refused_p50_ms / refused_p99_ms: how fast refusals came back.
        refusal_reasons: distinct refusal messages (first 80 characters) and their counts.
    """

    rate: float
    seconds: float
    sent: int = 0
    unsent: int = 0
    accepted: int = 0
    refused: int = 0
    errors: int = 0
    accepted_per_s: float = 0.0
    accepted_p50_ms: float = float("nan")
    accepted_p99_ms: float = float("nan")
    refused_p50_ms: float = float("nan")
    refused_p99_ms: float = float("nan")
    late_p99_ms: float = float("nan")
    refusal_reasons: dict[str, int] = field(default_factory=dict)
    error_samples: list[str] = field(default_factory=list)

    @property
    def refused_share(self) -> float:
        return self.refused / self.sent if self.sent else 0.0

    def row(self) -> dict:
        return {**asdict(self), "refused_share": self.refused_share}


def _ms_at(values: list[float], q: float) -> float:
    """Milliseconds at percentile ``q`` (0-100) of seconds, by the project's one rule (:func:`percentile`)."""
    return float(percentile(values, q / 100) * 1e3) if values else float("nan")


def summarize(rate: float, seconds: float, outcomes: list[Outcome]) -> OpenLoopResult:
    unsent = sum(o.status == UNSENT for o in outcomes)
    result = OpenLoopResult(rate, seconds, sent=len(outcomes) - unsent, unsent=unsent)
    ok = [o.latency for o in outcomes if o.status == 200]
    refused = [o for o in outcomes if o.status in RETRYABLE]
    result.accepted, result.refused = len(ok), len(refused)
    result.errors = result.sent - result.accepted - result.refused
    result.accepted_per_s = len(ok) / seconds
    result.accepted_p50_ms, result.accepted_p99_ms = _ms_at(ok, 50), _ms_at(ok, 99)
    result.refused_p50_ms = _ms_at([o.latency for o in refused], 50)
    result.refused_p99_ms = _ms_at([o.latency for o in refused], 99)
    result.late_p99_ms = _ms_at([o.late for o in outcomes], 99)
    for o in refused:
        reason = f"{o.status} {o.body[:80].decode(errors='replace')}"
        result.refusal_reasons[reason] = result.refusal_reasons.get(reason, 0) + 1
    result.error_samples = sorted({f"{o.status} {o.body[:120].decode(errors='replace')}" for o in outcomes
                                   if o.status not in (*RETRYABLE, 200, UNSENT)})[:5]
    return result


class Http:
    """Keep-alive HTTP/1.1 POSTs to one host:port over asyncio streams, over at most
    ``max_connections`` connections (a request waits for a free one, as behind a load balancer's
    pool; None: a new connection whenever none is idle)."""

    def __init__(self, address: str, path: str, timeout: float, max_connections: int | None = None):
        self.host, port = address.rsplit(":", 1)
        self.port, self.path, self.timeout = int(port), path, timeout
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._slots = asyncio.Semaphore(max_connections) if max_connections else None

    async def _exchange(self, body: bytes) -> tuple[int, bytes]:
        async with self._slots or contextlib.nullcontext():
            return await self._exchange_on_a_connection(body)

    async def _exchange_on_a_connection(self, body: bytes) -> tuple[int, bytes]:
        reader, writer = self._idle.pop() if self._idle else await asyncio.open_connection(self.host, self.port)
        try:
            header_length = getattr(body, "header_length", None)
            extra = b"" if header_length is None else b"Inference-Header-Content-Length: %d\r\n" % header_length
            writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n%s"
                         b"Content-Length: %d\r\n\r\n%s" % (self.path.encode(), self.host.encode(), extra,
                                                              len(body), body))
            status = int((await reader.readline()).split()[1])
            length, close = 0, False
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
                elif name.strip().lower() == b"connection" and value.strip().lower() == b"close":
                    close = True
            reply = await reader.readexactly(length)
        except BaseException:
            writer.close()
            raise
        if close:
            writer.close()
        else:
            self._idle.append((reader, writer))
        return status, reply

    async def post(self, body: bytes, due: float) -> Outcome:
        late = time.perf_counter() - due
        try:
            status, reply = await asyncio.wait_for(self._exchange(body), self.timeout)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, IndexError) as exc:
            return Outcome(0, time.perf_counter() - due, f"{type(exc).__name__}: {exc}".encode(), late)
        return Outcome(status, time.perf_counter() - due, reply, late)

    async def open(self, connections: int) -> None:
        """Open ``connections`` keep-alive connections before the run (as a load balancer holds
        them), so connection set-up is not part of what is measured."""
        for _ in range(connections):
            self._idle.append(await asyncio.open_connection(self.host, self.port))

    def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()


class Body(bytes):
    """A request body; ``header_length`` set: the binary tensor extension (the JSON header's
    length goes in the ``Inference-Header-Content-Length`` header, the tensors follow raw)."""

    header_length: int | None = None


def request_bodies(rows: int = 1, count: int = 256, seed: int = 0, timeout_s: float | None = None,
                   priority: int | None = None, binary: bool = False
                   ) -> tuple[list[bytes], list[tuple[np.ndarray, np.ndarray]]]:
    """``count`` bodies of ``rows`` synthetic rows each (and their arrays, to check scores);
    ``timeout_s`` / ``priority`` travel as the request's parameters, as the clients send them.
    ``binary``: inputs in the binary tensor extension, as the project's clients send them (the
    server parses far less than JSON); the score still comes back as JSON either way."""
    from ensemble.data import criteo
    from ensemble.features import transforms

    frame = criteo.synthesize(criteo.SynthConfig(rows=rows * count, scale=0.002, seed=seed)).frame
    dense, cats = transforms.dense_array(frame), transforms.encode_categorical(frame)
    arrays = [(dense[k * rows:(k + 1) * rows], cats[k * rows:(k + 1) * rows]) for k in range(count)]
    parameters = {k: v for k, v in (("timeout", None if timeout_s is None else int(timeout_s * 1e6)),
                                    ("priority", priority)) if v is not None}
    bodies = []
    for d, c in arrays:
        if binary:
            bodies.append(_binary_body(d, c, parameters))
            continue
        body = json.loads(schema.v2_json_request(d, c))
        if parameters:
            body["parameters"] = parameters
        bodies.append(json.dumps(body).encode())
    return bodies, arrays


def _binary_body(dense: np.ndarray, categorical: np.ndarray, parameters: dict) -> Body:
    import tritonclient.http as tc

    from clients.triton import Protocol, build_inputs

    inputs = build_inputs(tc, Protocol.HTTP, True, dense, categorical)
    outputs = [tc.InferRequestedOutput(schema.SCORE.name, binary_data=False)]
    raw, header_length = tc.InferenceServerClient.generate_request_body(
        inputs, outputs, priority=parameters.get("priority", 0), timeout=parameters.get("timeout"))
    body = Body(raw)
    body.header_length = header_length
    return body


async def open_loop(address: str, bodies: list[bytes], rate: float, seconds: float, timeout: float = 10.0,
                    model: str = schema.Model.RANKER.value, max_outstanding: int = 2000,
                    max_connections: int = 256) -> list[Outcome]:
    """Send ``rate * seconds`` requests at a fixed rate (bodies in turn); returns every outcome in
    send order. Beyond ``max_outstanding`` unanswered requests one is not sent (status
    :data:`UNSENT`): a bound on the generator. Requests share ``max_connections`` connections; one
    waiting for a free connection is late, and its latency counts from when it was due."""
    # A bounded pool, as a load balancer holds: thousands of new connections at once overflow the
    # server's listen backlog and come back as resets, which measure TCP, not the overload policy.
    http = Http(address, f"/v2/models/{model}/infer", timeout, max_connections)
    await http.open(min(max_connections, max(16, int(rate * 0.05))))  # 50 ms worth of requests
    total = int(rate * seconds)
    tasks: list[asyncio.Task] = []
    outstanding = 0

    async def one(k: int, due: float) -> Outcome:
        nonlocal outstanding
        outstanding += 1
        try:
            return await http.post(bodies[k % len(bodies)], due)
        finally:
            outstanding -= 1

    start = time.perf_counter() + 0.05
    for k in range(total):
        due = start + k / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if outstanding >= max_outstanding:
            tasks.append(asyncio.ensure_future(asyncio.sleep(0, Outcome(UNSENT, 0.0, b"generator limit"))))
            continue
        tasks.append(asyncio.ensure_future(one(k, due)))
    outcomes = list(await asyncio.gather(*tasks))
    http.close()
    return outcomes


async def closed_loop(address: str, bodies: list[bytes], users: int, seconds: float,
                      model: str = schema.Model.RANKER.value) -> float:
    """Answered requests per second with ``users`` requests always in flight (the capacity)."""
    http = Http(address, f"/v2/models/{model}/infer", 10.0)
    stop = time.perf_counter() + seconds
    done = 0

    async def user(u: int) -> None:
        nonlocal done
        k = u
        while time.perf_counter() < stop:
            outcome = await http.post(bodies[k % len(bodies)], time.perf_counter())
            done += outcome.status == 200
            k += users

    started = time.perf_counter()
    await asyncio.gather(*(user(u) for u in range(users)))
    http.close()
    return done / (time.perf_counter() - started)


def server_counters(address: str, model: str = schema.Model.RANKER.value) -> dict | None:
    """Triton's cumulative statistics of ``model``; None when the server does not answer them."""
    from loadtest.statistics import model_stats

    return model_stats(f"http://{address}/v2/models/{model}/stats")


def server_view(before: dict | None, after: dict | None) -> dict[str, float]:
    """What the server saw between two :func:`server_counters` readings: per request that reached
    the model (accepted and refused alike: both wait in the queue and share a call), the mean wait
    in Triton's queue and the mean call it was in, and requests per call. Set against the client's
    latency, the rest is the HTTP front end, the network and the generator."""
    from loadtest.statistics import stage_times

    stage = next(iter(stage_times(before, after).values()), None)
    if stage is None:
        return {}
    return {"server_queue_ms": stage["queue_ms"], "server_call_ms": stage["compute_ms"],
            "requests_per_call": stage["requests_per_call"]}


@dataclass(frozen=True)
class OverloadPlan:
    """Capacity: ``users`` closed-loop requests in flight for ``capacity_seconds`` (an estimate
    that batching can beat: ``rates`` gives absolute loads instead); then each multiple of that
    rate offered open-loop for ``seconds``."""

    users: int = 8
    capacity_seconds: float = 5.0
    multiples: tuple[float, ...] = (2.0,)
    seconds: float = 10.0
    rows: int = 1
    client_timeout: float = 1.0  # travels with each request (Triton's `timeout`; the clients send theirs)
    rates: tuple[float, ...] = ()  # absolute offered loads (req/s) instead of multiples of a capacity estimate
    binary: bool = False  # inputs in the binary tensor extension (the project's clients) instead of JSON


def overload(address: str, plan: OverloadPlan = OverloadPlan()) -> dict:
    """Measure capacity, then offer each multiple of it; returns {"capacity_per_s", "runs": [...]}."""
    bodies, _ = request_bodies(plan.rows, timeout_s=plan.client_timeout, binary=plan.binary)
    if plan.rates:  # no estimate: a closed loop of a few users does not find what batching absorbs
        capacity, rates = float("nan"), plan.rates
    else:
        capacity = asyncio.run(closed_loop(address, bodies, plan.users, plan.capacity_seconds))
        rates = tuple(capacity * m for m in plan.multiples)
    runs = []
    for rate in rates:
        before = server_counters(address)
        outcomes = asyncio.run(open_loop(address, bodies, rate, plan.seconds))
        runs.append({"multiple": rate / capacity, **summarize(rate, plan.seconds, outcomes).row(),
                     **server_view(before, server_counters(address))})
    return {"capacity_per_s": capacity, "rows": plan.rows, "users": plan.users, "runs": runs}


def format_table(found: dict) -> str:
    capacity = found["capacity_per_s"]
    lines = [f"capacity (closed loop): {capacity:.0f} req/s of {found['rows']} row(s)" if not math.isnan(capacity)
             else f"capacity: not estimated (absolute rates), {found['rows']} row(s) per request",
             "| offered | req/s | accepted/s | accepted p50 / p99 ms | refused | refusal p50 / p99 ms | errors "
             "| not sent (generator behind) | server: queue / call ms, mean | requests per call |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in found["runs"]:
        multiple = "-" if math.isnan(r["multiple"]) else f"{r['multiple']:.1f}x"
        server = (f"{r['server_queue_ms']:.1f} / {r['server_call_ms']:.1f} | {r['requests_per_call']:.1f}"
                  if "server_queue_ms" in r else "- | -")
        lines.append(f"| {multiple} | {r['rate']:.0f} | {r['accepted_per_s']:.0f} | "
                     f"{r['accepted_p50_ms']:.1f} / {r['accepted_p99_ms']:.1f} | {100 * r['refused_share']:.1f}% | "
                     f"{r['refused_p50_ms']:.1f} / {r['refused_p99_ms']:.1f} | {r['errors']} | {r.get('unsent', 0)} | "
                     f"{server} |")
    return "\n".join(lines)


def report_section(found: dict | None) -> list[str]:
    """The load-test report's overload section (Markdown lines; none when not run)."""
    if not found:
        return []
    if "capacity_per_s" not in found:
        return ["## Overload (open loop)", "", f"Not measured: {found.get('note', '')}", ""]
    return ["## Overload (open loop)", "",
            f"Capacity: answered requests per second with {found.get('users', 'many')} requests always in flight "
            "(closed loop). Then requests leave at a fixed multiple of that rate whatever the server answers "
            "(loadtest/openloop.py), each carrying a 1 s timeout. Latency counts from when a request was due. "
            "Refused: answered 503 (the ranker's admission: it would miss its deadline; the clients retry these). "
            "Server: Triton's own "
            "statistics over the run, per request that reached the model (accepted or refused): mean wait in "
            "its queue and mean length of the call it was in; the rest of a request's latency is the HTTP "
            "front end, the network and the generator.", "",
            *format_table(found).splitlines()[1:], ""]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.openloop", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", required=True, help="host:port of the server's HTTP endpoint")
    p.add_argument("--multiples", nargs="+", type=float, default=[2.0], help="offered load, times capacity")
    p.add_argument("--rates", nargs="+", type=float, default=[],
                   help="offered loads in req/s (instead of --multiples; capacity is then not estimated)")
    p.add_argument("--seconds", type=float, default=10.0, help="seconds per open-loop run")
    p.add_argument("--users", type=int, default=8, help="closed-loop requests in flight to measure capacity")
    p.add_argument("--rows", type=int, default=1, help="rows per request")
    p.add_argument("--binary", action="store_true",
                   help="send inputs in the binary tensor extension (as the clients do) instead of JSON")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    address = args.url.split("://", 1)[-1].rstrip("/")
    found = overload(address, OverloadPlan(args.users, multiples=tuple(args.multiples), seconds=args.seconds,
                                           rows=args.rows, rates=tuple(args.rates), binary=args.binary))
    print(format_table(found))
    if args.json:
        import sys

        from ensemble.base.machine import describe

        with open(args.json, "w") as handle:
            json.dump({"machine": describe(), "command": " ".join(["python -m loadtest.openloop", *sys.argv[1:]]),
                       **found}, handle, indent=2)
    return 1 if any(r["errors"] for r in found["runs"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
