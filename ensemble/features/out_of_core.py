"""Features out of core: Criteo files -> raw Parquet parts -> NVTabular on Dask -> tensor shards.

The input is read in chunks and split by row order into train / valid / test parts (raw
columns, Parquet, ``part_rows`` rows each); the NVTabular workflow (the same graph as
:func:`ensemble.features.transforms.fit_workflow`) is fitted on a Dask-backed ``merlin.io.Dataset`` over
the training parts and applied partition by partition, and each transformed partition is
written once as a shard of model-ready tensors (:mod:`ensemble.data.shards`). No step holds
more than a few partitions, so memory does not grow with the number of rows. With a
``distributed.Client`` the fit and the transform run on its workers.
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Sequence

import numpy as np

from ensemble import schema
from ensemble.dataset import DatasetSpec
from ensemble.data import shards

PART_ROWS = 250_000  # raw rows per part: ~0.5 GB as pandas objects (26 string columns)


class Split(str, Enum):
    TRAIN = "train"
    VALID = "valid"
    TEST = "test"


@dataclass(frozen=True)
class SplitParts:
    """Raw Parquet parts of each split, in row order."""

    parts: dict[Split, list[Path]]
    rows: dict[Split, int]


def count_lines(paths: Sequence[str | Path]) -> int:
    """Lines in plain or .gz files (read in 16 MB blocks)."""
    total = 0
    for path in paths:
        opener = gzip.open if str(path).endswith(".gz") else open
        with opener(path, "rb") as handle:
            while block := handle.read(1 << 24):
                total += block.count(b"\n")
    return total


def _raw_schema():
    import pyarrow as pa

    fields = [pa.field(schema.LABEL, pa.int8())]
    fields += [pa.field(c, pa.float32()) for c in schema.DENSE_COLUMNS]
    fields += [pa.field(c, pa.string()) for c in schema.CATEGORICAL_COLUMNS]
    return pa.schema(fields)


def split_to_parts(paths: Sequence[str | Path], out_dir: str | Path, valid: float = 0.1, test: float = 0.1,
                   nrows: int | None = None, part_rows: int = PART_ROWS) -> SplitParts:
    """Read labelled Criteo files in chunks and write each split's rows as Parquet parts.

    The split is by row order, as :func:`ensemble.data.criteo.split` does in memory (same row counts).

    Returns:
        The parts of each split and their row counts.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ensemble.data import criteo

    if not paths:
        raise ValueError("no input files given")
    n = count_lines(paths) if nrows is None else min(nrows, count_lines(paths))
    n_test, n_valid = int(n * test), int(n * valid)
    bounds = {Split.TRAIN: (0, n - n_valid - n_test), Split.VALID: (n - n_valid - n_test, n - n_test),
              Split.TEST: (n - n_test, n)}
    out_dir = Path(out_dir)
    parts: dict[Split, list[Path]] = {s: [] for s in Split}
    raw_schema = _raw_schema()
    position = 0
    for path in paths:
        for chunk in criteo.parse_criteo(path, chunksize=part_rows):
            for split, (lo, hi) in bounds.items():
                a, b = max(lo - position, 0), min(hi - position, len(chunk))
                if a >= b:
                    continue
                folder = out_dir / split.value
                folder.mkdir(parents=True, exist_ok=True)
                target = folder / f"part-{len(parts[split]):05d}.parquet"
                table = pa.Table.from_pandas(chunk.iloc[a:b], schema=raw_schema, preserve_index=False)
                pq.write_table(table, str(target))
                parts[split].append(target)
            position += len(chunk)
            if position >= n:
                break
        if position >= n:
            break
    return SplitParts(parts, {s: hi - lo for s, (lo, hi) in bounds.items()})


def _dataset(parts: Sequence[Path], part_size: str = "2GB"):
    """A Dask-backed ``merlin.io.Dataset`` over raw parts: one partition per part (the parts are
    written one row group each and far below ``part_size``)."""
    from merlin.io import Dataset

    return Dataset([str(p) for p in parts], engine="parquet", part_size=part_size, cpu=True)


def fit(train_parts: Sequence[Path], out_dir: str | Path, freq_threshold: int = 3, client=None,
        spec: DatasetSpec = schema.CRITEO):
    """Fit the workflow on the training parts (on ``client``'s cluster when given) and save it.

    Returns:
        The fitted ``Workflow``.
    """
    from ensemble.features import transforms

    out_dir = Path(out_dir)
    workflow = transforms.build_workflow(out_dir, freq_threshold, client, spec)
    workflow.fit(_dataset(train_parts))
    transforms.save_workflow(workflow, out_dir, spec)
    return workflow


def _write_partition(frame, folder: str, index: int, spec: DatasetSpec = schema.CRITEO) -> int:
    """Runs where the partition was computed: transformed frame -> one shard (hashed columns' ids
    from their passed-through values)."""
    from ensemble.features import transforms

    dense = frame[list(schema.DENSE_COLUMNS)].to_numpy(np.float32)
    ids = transforms.model_ids(frame, spec)
    if len(frame) == 0:
        return 0
    shards.write_shard(Path(folder) / f"part-{index:05d}.parquet", dense, ids, frame[schema.LABEL].to_numpy(np.int8))
    return len(frame)


def transform_to_shards(workflow, parts: Sequence[Path], out_folder: str | Path, client=None,
                        threads: int = 2, spec: DatasetSpec = schema.CRITEO) -> shards.ShardSet:
    """Apply the fitted workflow to raw parts on Dask, the label passed through, and write each
    transformed partition as one shard (computed ``threads`` at a time here, or on the cluster).

    Returns:
        The written :class:`ensemble.data.shards.ShardSet` (shards in row order).
    """
    import dask

    out_folder = Path(out_folder)
    out_folder.mkdir(parents=True, exist_ok=True)
    dataset = _dataset(parts)
    inputs = [*schema.DENSE_COLUMNS, *schema.CATEGORICAL_COLUMNS]
    ddf = dataset.to_ddf(columns=[*inputs, schema.LABEL])
    # NVTabular's own Dask executor, as Workflow.transform(Dataset) calls it, asked to carry the
    # label through (the saved workflow's outputs stay the serving features only).
    out = workflow.executor.transform(ddf, workflow.output_node, workflow.output_dtypes,
                                      additional_columns=[schema.LABEL])
    writes = [dask.delayed(_write_partition)(part, str(out_folder), i, spec) for i, part in enumerate(out.to_delayed())]
    if client is not None:
        counts = client.gather(client.compute(writes))
    else:
        counts = dask.compute(*writes, scheduler="threads", num_workers=threads)
    kept = [(f"part-{i:05d}.parquet", c) for i, c in enumerate(counts) if c > 0]
    shard_set = shards.ShardSet(out_folder, tuple(f for f, _ in kept), tuple(c for _, c in kept))
    shard_set.save()
    return shard_set


def build_shards(paths: Sequence[str | Path], workdir: str | Path, workflow_dir: str | Path,
                 freq_threshold: int = 3, valid: float = 0.1, test: float = 0.1, nrows: int | None = None,
                 part_rows: int = PART_ROWS, client=None, keep_parts: bool = False,
                 spec: DatasetSpec = schema.CRITEO) -> dict[Split, shards.ShardSet]:
    """Criteo files -> fitted workflow in ``workflow_dir`` + shards of every split under
    ``<workdir>/shards/<split>/`` (raw parts in ``<workdir>/parts``, removed unless ``keep_parts``)."""
    import shutil

    workdir = Path(workdir)
    raw = split_to_parts(paths, workdir / "parts", valid, test, nrows, part_rows)
    if not raw.parts[Split.TRAIN]:
        raise ValueError("no training rows in the input")
    workflow = fit(raw.parts[Split.TRAIN], workflow_dir, freq_threshold, client, spec)
    out = {split: transform_to_shards(workflow, raw.parts[split], workdir / "shards" / split.value, client, spec=spec)
           for split in Split if raw.parts[split]}
    if not keep_parts:
        shutil.rmtree(workdir / "parts", ignore_errors=True)
    return out
