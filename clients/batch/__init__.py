"""`ensemble score`: a batch-scoring run over every partition (its input: :mod:`clients.batch.input`; a partition
scored: :mod:`clients.batch.score`), in this process or across a Dask cluster.

Single process: one output file (Parquet or CSV). Dask: an output folder with one Parquet part
per input partition and ``manifest.json``; the folder is built as ``<output>.partial`` and
renamed when every part is in.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import pandas as pd

from clients.batch.input import BadInput, LineReport, Partition, plan_partitions
from clients.batch.score import ChunkFailed, OutputWriter, ScoreSettings, Summary, local_pipeline, output_schema, score_chunks
from clients.progress import INPUT_BYTES, Progress
from ensemble import schema

MANIFEST = "manifest.json"


def score_files(paths: list[str], output: str, settings: ScoreSettings, progress: bool = True,
                partition_bytes: int = 64 << 20) -> Summary:
    """Score every input into one output file, rows in input order.

    Raises:
        ChunkFailed: a chunk kept failing; nothing is left at ``output``.
    """
    parts = plan_partitions(paths, partition_bytes, settings.dataset)
    loading = time.perf_counter()
    if settings.local:  # load the models before the clock starts: rows/s is scoring throughput
        local_pipeline(str(Path(settings.repository).resolve()))
    summary = Summary(output=str(output), load_seconds=time.perf_counter() - loading if settings.local else 0.0)
    started = time.perf_counter()
    writer = OutputWriter(output, output_schema(parts, settings.all_scores, settings.dataset))
    bar = Progress(parts, progress)
    try:
        for part in parts:
            for frame in score_chunks(part, settings, report=summary.lines):
                writer.write(frame)
                summary.observe(frame, settings.dataset.label)
                bar.chunk(part, len(frame), frame.attrs.get(INPUT_BYTES, 0))
            bar.part_done(part)
            summary.parts += 1
        summary.rows = writer.rows
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    return summary.finish(time.perf_counter() - started)


def score_partition_to_file(part: Partition, out_dir: str, settings: ScoreSettings, arrow_schema) -> dict:
    """Dask task: score one partition into ``part-<index>.parquet`` (written aside, renamed)."""
    target = Path(out_dir) / f"part-{part.index:05d}.parquet"
    writer = OutputWriter(target, arrow_schema)
    report = LineReport()
    try:
        for frame in score_chunks(part, settings, report=report):
            writer.write(frame)
        rows = writer.rows
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    return {"part": target.name, "input": part.path, "start": part.start, "stop": part.stop, "rows": rows,
            "skipped_lines": report.skipped, "skipped_examples": report.examples}


def score_files_dask(paths: list[str], output: str, settings: ScoreSettings, scheduler: str | None = None,
                     local_workers: int = 0, progress: bool = True, partition_bytes: int = 64 << 20) -> Summary:
    """Partition the inputs across a Dask cluster (``scheduler`` address, or a LocalCluster of
    ``local_workers`` processes); each worker scores against the URLs (or in-process)."""
    import logging

    from dask.distributed import Client, LocalCluster, as_completed

    logging.getLogger("distributed").setLevel(logging.WARNING)
    started = time.perf_counter()
    out = Path(output)
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    parts = plan_partitions(paths, partition_bytes, settings.dataset)
    arrow_schema = output_schema(parts, settings.all_scores, settings.dataset)
    cluster = None if scheduler else LocalCluster(n_workers=max(1, local_workers), threads_per_worker=1,
                                                  processes=True, dashboard_address=None)
    client = Client(scheduler or cluster)
    bar = Progress(parts, progress)
    try:
        futures = {client.submit(score_partition_to_file, p, str(staging), settings, arrow_schema, key=f"score-{p.index}",
                                 pure=False, retries=1): p for p in parts}
        results = []
        for future in as_completed(futures):
            result = future.result()  # re-raises ChunkFailed from the worker
            results.append(result)
            bar.part_done(futures[future], result["rows"])
        results.sort(key=lambda r: r["part"])
        manifest = {"parts": results, "rows": sum(r["rows"] for r in results), "inputs": list(map(str, paths)),
                    "settings": {k: v for k, v in asdict(settings).items() if k != "retry"},
                    "columns": arrow_schema.names}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        bar.close()
        client.close()
        if cluster is not None:
            cluster.close()
    summary = Summary(output=str(out), parts=len(parts))
    for result in results:
        summary.lines.skipped += result["skipped_lines"]
        summary.lines.examples += result["skipped_examples"][:3 - len(summary.lines.examples)]
    for frame in read_parts(out, columns=[schema.LABEL, schema.SCORE.name]):
        summary.rows += len(frame)
        summary.observe(frame)
    return summary.finish(time.perf_counter() - started)


def read_parts(folder: str | Path, columns: list[str] | None = None):
    """Frames of a Dask output folder, in input order (as listed in its manifest)."""
    import pyarrow.parquet as pq

    folder = Path(folder)
    manifest = json.loads((folder / MANIFEST).read_text())
    for entry in manifest["parts"]:
        available = pq.ParquetFile(folder / entry["part"]).schema_arrow.names
        wanted = None if columns is None else [c for c in columns if c in available]
        yield pd.read_parquet(folder / entry["part"], columns=wanted)


__all__ = ["BadInput", "ChunkFailed", "score_files", "score_files_dask", "read_parts"]
