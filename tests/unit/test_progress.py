"""The batch-scoring progress bar: its total is the input's bytes, chunks advance it as they are
read (plain TSV, .gz, Parquet), it ends at exactly 100%; framework info lines are held back."""

import gzip
import os
import shutil
import sys

import pytest

from clients.batch.input import plan_partitions, read_chunks, read_partition
from clients.progress import INPUT_BYTES, Progress, partition_bytes
from ensemble.base.console import framework_info_quieted
from ensemble.data import criteo


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("progress")
    frame = criteo.synthesize(criteo.SynthConfig(rows=3000, scale=0.002, seed=5)).frame
    tsv = criteo.write_criteo(frame, root / "rows.tsv")
    with open(tsv, "rb") as src, gzip.open(root / "rows.tsv.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    frame.to_parquet(root / "rows.parquet", row_group_size=700)
    return {"tsv": str(tsv), "gz": str(root / "rows.tsv.gz"), "parquet": str(root / "rows.parquet")}


def _chunk_frames(part, chunk_rows):
    return (chunk.frame for chunk in read_chunks(part, chunk_rows))


@pytest.mark.parametrize("reader", [read_partition, _chunk_frames], ids=["frames", "chunks"])
@pytest.mark.parametrize("kind", ["tsv", "gz", "parquet"])
def test_bar_total_is_the_input_size_and_chunks_advance_it(inputs, kind, reader):
    parts = plan_partitions([inputs[kind]], partition_bytes=100_000)
    total = os.path.getsize(inputs[kind])
    assert abs(sum(partition_bytes(p) for p in parts) - total) <= len(parts)  # rounding of row-group shares
    bar = Progress(parts, enabled=False)
    assert bar.total == sum(partition_bytes(p) for p in parts)
    rows = 0
    for part in parts:
        for frame in reader(part, chunk_rows=250):
            bar.chunk(part, len(frame), frame.attrs[INPUT_BYTES])
            rows += len(frame)
        if kind != "gz":  # the compressed stream is read ahead in blocks: most of a small file at once
            assert bar.done >= 0.9 * sum(partition_bytes(p) for p in parts[:part.index + 1])
        bar.part_done(part)
    assert rows == bar.rows == 3000 and bar.done == bar.total
    bar.close()


def test_framework_info_lines_are_held_back_and_the_rest_passed_on(capfd):
    with framework_info_quieted():
        os.write(2, b"INFO: Created TensorFlow Lite XNNPACK delegate for CPU.\n")
        os.write(2, b"I0000 00:00:1795396058.763184   24042 reader.cc:83] Reading SavedModel\n")
        os.write(2, b"WARNING: something the user should see\n")
        print("a Python warning line", file=sys.stderr)
    err = capfd.readouterr().err
    assert "XNNPACK" not in err and "Reading SavedModel" not in err
    assert "WARNING: something the user should see" in err and "a Python warning line" in err
