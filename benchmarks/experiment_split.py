"""An experiment's arms over many keyed requests: does each arm get its share, and each key one arm?

Not a test: prints a table and writes ``<out>/experiment-split.json``. What it runs, on loopback:

1. A private copy of ``--repository`` with one more release exported from ``--workdir`` (the
   candidate); the copy declares its previous newest release, which the fleet serves.
2. ``ensemble serve --replicas N`` on it, then ``ensemble experiment start --candidate NEW --share P
   --key x-user`` through the gateway.
3. ``--requests`` 1-row requests through the gateway, each with an ``x-user`` key drawn at random
   from ``--keys`` users (the header; with ``--key-in parameter``, the request parameter), sent by
   ``--clients`` plain tritonclient clients (half HTTP, half gRPC, no retries); every answer's
   ``model_version`` is recorded per key.
4. ``ensemble experiment abort``.

The targets (issue "Try a new ranker on live traffic"): each arm's share of the requests within 1
percentage point of its setting; 0 keys answered by more than one release. Usage (after ``ensemble
demo``)::

    .venv/bin/python -m benchmarks.experiment_split --repository model_repository --workdir build
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from collections import defaultdict

from benchmarks import write_results
from benchmarks.fleet_setup import private_repository, serve_fleet
from benchmarks.gateway_overhead import one_row_inputs
from ensemble import schema
from ensemble.base.machine import summary

KEY = "x-user"


def _client(index: int, protocol: str, address: str, keys: list[str], seen: dict, errors: list[str],
            key_in: str = "header") -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    module = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(address)
    inputs = one_row_inputs(module, index)
    for key in keys:
        try:
            where = {"headers": {KEY: key}} if key_in == "header" else {"parameters": {KEY: key}}
            response = client.infer(schema.Model.RANKER.value, inputs, **where).get_response()
            seen[key].append(int(response["model_version"] if protocol == "http" else response.model_version))
        except Exception as exc:  # noqa: BLE001 - every failure counts
            errors.append(f"{type(exc).__name__}: {exc}"[:300])
    client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repository", default="model_repository")
    parser.add_argument("--workdir", default="build", help="what `ensemble train` left (the candidate's export)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--keys", type=int, default=20_000)
    parser.add_argument("--share", type=float, default=10.0, help="the candidate's percent of requests")
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--key-in", choices=("header", "parameter"), default="header",
                        help="where each request carries its key")
    parser.add_argument("--out", default="docs/results")
    args = parser.parse_args(argv)

    from ensemble import cli
    from ensemble.fleet.arms import arm_of
    from ensemble.repository import declared

    scratch, repository, (candidate,) = private_repository(args.repository, [args.workdir], "experiment-split-")
    serving = declared.read(repository)
    served = serve_fleet(repository, args.replicas, scratch)
    gateway, grpc_port = served.gateway, served.grpc_port
    try:
        if served.record() is None or cli.main(["experiment", "start", "--url", gateway, "--candidate",
                                                str(candidate), "--share", f"{args.share:g}", "--key", KEY]) != 0:
            print("\n".join(served.log[-30:]), file=sys.stderr)
            return 1
        rng = random.Random(args.seed)
        users = [f"user-{rng.getrandbits(48):012x}" for _ in range(args.keys)]
        sent = [rng.choice(users) for _ in range(args.requests)]
        seen: dict[str, list[int]] = defaultdict(list)
        errors: list[str] = []
        started = time.monotonic()
        threads = [threading.Thread(target=_client, args=(i, "http" if i % 2 == 0 else "grpc",
                                                          gateway if i % 2 == 0 else f"127.0.0.1:{grpc_port}",
                                                          sent[i::args.clients], seen, errors, args.key_in))
                   for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.monotonic() - started
        cli.main(["experiment", "abort", "--url", gateway])
    finally:
        served.stop()
    arms = ((candidate, args.share),)
    answered = [v for versions in seen.values() for v in versions]
    shares = {r: 100.0 * answered.count(r) / max(len(answered), 1) for r in (serving, candidate)}
    switched = sum(len(set(v)) > 1 for v in seen.values())
    unexpected = sum(any(x != arm_of(k, serving, arms) for x in v) for k, v in seen.items())
    result = {"serving": serving, "candidate": candidate, "share_set": args.share, "requests": args.requests,
              "answered": len(answered), "failed": len(errors), "errors": errors[:5], "keys": len(seen),
              "repeated_keys": sum(len(v) > 1 for v in seen.values()), "shares": {str(r): s for r, s in shares.items()},
              "keys_that_changed_arm": switched, "keys_off_their_computed_arm": unexpected, "seconds": seconds,
              "replicas": args.replicas, "clients": args.clients, "key_in": args.key_in}
    print(f"| release | set | share of {len(answered):,} answered requests |\n| --- | --- | --- |\n"
          f"| {candidate} (candidate) | {args.share:g}% | {shares[candidate]:.2f}% |\n"
          f"| {serving} (serving) | {100 - args.share:g}% | {shares[serving]:.2f}% |")
    print(f"\n{len(seen):,} keys ({result['repeated_keys']:,} sent more than once): {switched} answered by more than "
          f"one release, {unexpected} off the arm arm_of computes; {len(errors)} failed; {seconds:.1f} s")
    name = "experiment-split.json" if args.key_in == "header" else f"experiment-split-{args.key_in}.json"
    write_results(args.out, name, "benchmarks.experiment_split", summary(), **result)
    return 0 if not errors and switched == 0 and abs(shares[candidate] - args.share) <= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
