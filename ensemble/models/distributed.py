"""Training past one process: a Dask cluster for the features and the trees, and one
``torch.distributed`` (gloo) process per worker for the PyTorch DLRM.

``--dask-scheduler ADDR`` joins a running cluster; ``--dask-local N`` starts a LocalCluster of N
single-threaded worker processes on this machine (what the tests and the benchmark use here).
"""

from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def dask_client(scheduler: str | None = None, local_workers: int = 0) -> Iterator[object | None]:
    """A ``distributed.Client`` for the given scheduler address or a new LocalCluster of
    ``local_workers`` processes; None (run in this process) when neither is given."""
    if scheduler and local_workers:
        raise ValueError("give a scheduler address or a number of local workers, not both")
    if not scheduler and not local_workers:
        yield None
        return
    from distributed import Client, LocalCluster

    if scheduler:
        with Client(scheduler) as client:
            yield client
        return
    with LocalCluster(n_workers=local_workers, threads_per_worker=1, processes=True, dashboard_address=None,
                      memory_limit=0) as cluster, Client(cluster) as client:
        yield client
