"""Training past one process: a Dask cluster for the features and the trees, and one
``torch.distributed`` (gloo) process per worker for the PyTorch DLRM.

``--dask-scheduler ADDR`` joins a running cluster; ``--dask-local N`` starts a LocalCluster of N
single-threaded worker processes on this machine (what the tests and the benchmark use here).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterator

from ensemble.base.machine import free_port
from ensemble.base.device import Device


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
                      memory_limit=0, silence_logs=logging.ERROR) as cluster, Client(cluster) as client:
        yield client


def _read_frame(path: str):
    """One shard as a pandas frame: 13 dense + 26 id columns as float32 (the design matrix), label."""
    import pandas as pd

    from ensemble.data.shards import read_shard
    from ensemble.models.xgb import design_matrix

    dense, ids, labels = read_shard(path)
    frame = pd.DataFrame(design_matrix(dense, ids), columns=[f"f{k}" for k in range(dense.shape[1] + ids.shape[1])])
    frame["label"] = labels
    return frame


def _shard_frames(client, shard_set):
    """A dask DataFrame over a split's shards, shard k loaded on worker ``k % workers`` (the
    DLRM ranks' split of the shards), -> (features, label)."""
    import dask.dataframe as dd

    workers = sorted(client.scheduler_info()["workers"])
    futures = [client.submit(_read_frame, str(path), workers=[workers[k % len(workers)]], pure=False)
               for k, path in enumerate(shard_set.paths)]
    frame = dd.from_delayed(futures, meta=_read_frame(str(shard_set.paths[0])).iloc[:0], verify_meta=False)
    return frame.drop(columns=["label"]), frame["label"]


def train_trees(client, config, train_shards, valid_shards, device: Device = Device.CPU):
    """XGBoost on the cluster (``xgboost.dask``): each worker builds the quantile matrix of the
    shards it holds; trees are grown collectively. Shards must be readable by every worker
    (a shared filesystem, or one machine). Returns the booster cut at its best validation round.

    The design matrix is the one :func:`ensemble.models.xgb.design_matrix` builds: 13 dense
    features then 26 ids as float32.
    """
    import xgboost as xgb
    from xgboost import dask as dxgb

    from ensemble.models.xgb import _params

    params = {**_params(config, device), "nthread": 1}
    # Shards are loaded on chosen workers, as the DLRM ranks split them. A split with fewer shards
    # than workers leaves some workers' matrices empty (XGBoost warns; the result is still right).
    x, y = _shard_frames(client, train_shards)
    vx, vy = _shard_frames(client, valid_shards)
    dtrain = dxgb.DaskQuantileDMatrix(client, x, y, max_bin=256)
    dvalid = dxgb.DaskQuantileDMatrix(client, vx, vy, ref=dtrain)
    out = dxgb.train(client, params, dtrain, num_boost_round=config.rounds, evals=[(dvalid, "valid")],
                     early_stopping_rounds=config.early_stopping, verbose_eval=False)
    booster: xgb.Booster = out["booster"]
    return booster[: booster.best_iteration + 1]




def _ddp_rank(rank: int, world: int, address: str, port: int, config, train_shards, valid_shards,
              buffer_rows: int, out_file: str) -> dict:
    """One torch.distributed process: train on every ``world``-th shard from ``rank`` under DDP.

    Each rank's batch is ``batch_size / world`` rows, so one synchronous step sees as many rows as
    a single-process step; ``DDP.join`` lets ranks whose shards hold fewer batches finish the
    epoch without stalling the others (every row is still used once per epoch). Rank 0 scores the
    validation shards after each epoch and saves the best epoch's weights to ``out_file``.
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ensemble.models import metrics
    from ensemble.models import dlrm_torch
    from ensemble.models.dlrm import score_source

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank, world_size=world)
    try:
        model = dlrm_torch.build(config)  # the same seed on every rank: identical initial weights
        ddp = DistributedDataParallel(_logits_module(model))
        optimizer = torch.optim.Adam(model.parameters(), lr=config.learning_rate)
        loss_fn = torch.nn.BCEWithLogitsLoss()
        source = train_shards.partition(rank, world).source(max(1, config.batch_size // world), config.seed + rank,
                                                            True, buffer_rows)
        best, history = float("inf"), []
        for epoch in range(config.epochs):
            ddp.train()
            with ddp.join():
                for dense, ids, labels in source.epoch(epoch):
                    y = torch.from_numpy(labels).float().reshape(-1, 1)
                    loss = loss_fn(ddp(torch.from_numpy(dense), torch.from_numpy(ids)), y)
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
            if rank == 0:
                scores, labels = score_source(lambda d, i: dlrm_torch.predict(model, d, i),
                                              valid_shards.source(65536, shuffle=False))
                val_loss = metrics.log_loss(labels, scores)
                history.append({"epoch": epoch + 1, "valid_logloss": val_loss, "valid_auc": metrics.auc(labels, scores)})
                if val_loss < best:
                    best = val_loss
                    torch.save(model.state_dict(), out_file)
            dist.barrier()
        return {"rank": rank, "rows": source.rows, "history": history}
    finally:
        dist.destroy_process_group()


def _logits_module(model):
    """``model.logits`` as a module's ``forward``: DDP synchronises gradients of what its wrapped
    module's forward computes, and training needs the logits, not the served sigmoid."""
    from torch import nn

    class Logits(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, dense, ids):
            return self.inner.logits(dense, ids)

    return Logits(model)


def train_torch(config, train_shards, valid_shards, work_dir, client=None, world: int = 2,
                buffer_rows: int = 1 << 20, log=print):
    """The PyTorch DLRM under ``torch.distributed`` (gloo), one process per Dask worker when a
    client is given (``world`` = its worker count), else ``world`` processes spawned here.

    Returns:
        (the best epoch's model on CPU, per-rank summaries).
    """
    import torch

    from ensemble.models import dlrm_torch

    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    out_file = str(work_dir / "dlrm_torch-ddp.pt")
    if client is not None:
        workers = sorted(client.scheduler_info()["workers"])
        world = len(workers)
        address = workers[0].split("://", 1)[-1].rsplit(":", 1)[0]
        port = client.submit(free_port, workers=[workers[0]], pure=False).result()
        futures = [client.submit(_ddp_rank, rank, world, address, port, config, train_shards, valid_shards,
                                 buffer_rows, out_file, workers=[w], pure=False, allow_other_workers=False)
                   for rank, w in enumerate(workers)]
        summaries = client.gather(futures)
    else:
        import torch.multiprocessing as mp

        port = free_port()
        context = mp.get_context("spawn")
        with context.Pool(world) as pool:
            summaries = pool.starmap(_ddp_rank, [(rank, world, "127.0.0.1", port, config, train_shards, valid_shards,
                                                  buffer_rows, out_file) for rank in range(world)])
    for entry in summaries[0]["history"]:
        log(f"  dlrm_torch (ddp x{world}) epoch {entry['epoch']}: valid logloss {entry['valid_logloss']:.4f} "
            f"auc {entry['valid_auc']:.4f}")
    model = dlrm_torch.build(config)
    model.load_state_dict(torch.load(out_file))
    return model.eval(), summaries
