"""How this project's processes import ``grpc``: with its blocking client calls polled by the calling thread.

grpcio (1.85) reads a blocking call's response on its event-engine threads by default, and one of
them then wakes the calling thread: about four thread switches a call. With the
``event_engine_client`` experiment off, the calling thread polls its own call's socket instead. On
the 2-vCPU build VM that took the project's 1-row gRPC request from p50 0.68-0.73 ms to
0.57-0.61 ms (``benchmarks.sequential``, three alternating pairs; docs/serving.md, "Sequential
latency"), and batch scoring over gRPC kept its rate.

grpcio reads ``GRPC_EXPERIMENTS`` once, while ``grpc`` is imported, so every ``ensemble`` command
(before any library imports it: NVTabular does, through ``tritonclient.grpc``), the project's
clients (``clients.triton``), the config reader (``repository.configs``, which the server launcher
uses) and the model control call :func:`import_grpc` before they import gRPC. The variable is set only for that import: child
processes (tritonserver, perf_analyzer, locust) do not inherit it and keep their defaults, as do
the scripts that stand for a plain Triton user (``loadtest.plain_clients``, the gateway and fleet
benchmarks' clients) when run on their own. A value the user has set, empty included, is kept; a
process that imported ``grpc`` before the project did keeps what it has.
"""

from __future__ import annotations

import os
import sys

VARIABLE = "GRPC_EXPERIMENTS"
CALLING_THREAD_POLLING = "-event_engine_client"


def import_grpc() -> None:
    """Import ``grpc`` for this process (once), with calling-thread polling unless the user chose."""
    if "grpc" in sys.modules:
        return
    chosen = VARIABLE in os.environ
    if not chosen:
        os.environ[VARIABLE] = CALLING_THREAD_POLLING
    try:
        import grpc  # noqa: F401 - imported for its side effect: grpcio reads its settings now
    finally:
        if not chosen:
            os.environ.pop(VARIABLE, None)
