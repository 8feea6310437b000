"""Plain ``tritonclient`` against a running server, as a Triton user would call it: no retries,
one client object per thread, each thread sending a fixed number of requests back to back.

Not a test: prints how many requests each point answered and writes a JSON file. Every request
must be answered; the exit status is 1 otherwise. ::

    .venv/bin/python -m loadtest.plain_clients --http-url 127.0.0.1:8000 --grpc-url 127.0.0.1:8001
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

from clients.triton import Protocol, build_inputs, build_outputs
from ensemble import schema
from ensemble.data import criteo
from ensemble.features import transforms
from ensemble.base.machine import summary


def infer_once(client, module, protocol: Protocol, dense, cats) -> None:
    """One ranker request through a plain tritonclient ``client`` of ``module`` (tritonclient.http or
    .grpc), as a Triton user writes it; raises on an error or a score of the wrong shape."""
    result = client.infer(schema.Model.RANKER.value, build_inputs(module, protocol, True, dense, cats),
                          outputs=build_outputs(module, protocol, True, False))
    if result.as_numpy(schema.SCORE.name).shape != (len(dense), 1):
        raise ValueError(f"score shape {result.as_numpy(schema.SCORE.name).shape}")


def point(url: str, protocol: Protocol, threads: int, requests: int, rows: int, dense, cats) -> dict:
    """``threads`` plain clients, ``requests`` each of ``rows`` rows: answered, errors, seconds."""
    import tritonclient.grpc as grpc_client
    import tritonclient.http as http_client

    module = grpc_client if protocol is Protocol.GRPC else http_client
    answered, errors = [0] * threads, []

    def user(u: int) -> None:
        try:
            client = module.InferenceServerClient(url)
        except Exception as exc:  # noqa: BLE001 - then no request of this thread was answered
            errors.extend([f"{type(exc).__name__}: {exc}"[:300]] * requests)
            return
        try:
            for i in range(requests):
                start = (u * requests + i) * rows % (len(dense) - rows)
                try:
                    infer_once(client, module, protocol, dense[start:start + rows], cats[start:start + rows])
                    answered[u] += 1
                except Exception as exc:  # noqa: BLE001 - every failure is counted and shown
                    errors.append(f"{type(exc).__name__}: {exc}"[:300])
        finally:
            client.close()

    started = time.perf_counter()
    workers = [threading.Thread(target=user, args=(u,)) for u in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return {"protocol": protocol.value, "threads": threads, "rows": rows, "sent": threads * requests,
            "answered": sum(answered), "errors": len(errors), "first_errors": errors[:3],
            "seconds": time.perf_counter() - started}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--http-url", default="127.0.0.1:8000")
    p.add_argument("--grpc-url", default="127.0.0.1:8001")
    p.add_argument("--threads", nargs="+", type=int, default=[1, 4, 16, 32])
    p.add_argument("--requests", type=int, default=40, help="per thread")
    p.add_argument("--rows", nargs="+", type=int, default=[1, 100])
    p.add_argument("--json", default="build/plain-clients.json", help="where the results go")
    args = p.parse_args(argv)
    frame = criteo.synthesize(criteo.SynthConfig(rows=2_000, scale=0.01, seed=23)).frame
    dense, cats = transforms.dense_array(frame), transforms.encode_categorical(frame)
    results = []
    for protocol, url in ((Protocol.HTTP, args.http_url), (Protocol.GRPC, args.grpc_url)):
        for rows in args.rows:
            for threads in args.threads:
                r = point(url, protocol, threads, args.requests, rows, dense, cats)
                results.append(r)
                print(f"{protocol.value} {rows} row(s) x {threads} thread(s): {r['answered']} of {r['sent']} "
                      f"answered, {r['errors']} errors in {r['seconds']:.1f} s"
                      + (f"; first: {r['first_errors'][0]}" if r["errors"] else ""), flush=True)
    sent, answered = sum(r["sent"] for r in results), sum(r["answered"] for r in results)
    print(f"all points: {answered:,} of {sent:,} answered")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": summary(), "command": " ".join(["python -m loadtest.plain_clients", *sys.argv[1:]]),
                               "answered": answered, "sent": sent, "results": results}, indent=1))
    print(f"wrote {out}")
    return 0 if answered == sent else 1


if __name__ == "__main__":
    sys.exit(main())
