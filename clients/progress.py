"""What `ensemble score` shows while it runs: a progress bar over the input's bytes (known before
the run, so the bar has a total and an ETA) with rows and rows/s beside it, and framework log
lines kept off the terminal while the bar is drawn.

Rows are not known before a TSV file is read to its end; bytes are: a plain TSV partition is a
byte range, a .gz file counts its compressed size (read position of the compressed stream), and
a Parquet row group its share of the file by rows.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

# DataFrame.attrs key: how many input bytes a chunk was read from (set by read_partition).
INPUT_BYTES = "input_bytes"

# Framework lines written straight to file descriptor 2 from C++: LiteRT's "INFO: Created
# TensorFlow Lite XNNPACK delegate for CPU." (no switch turns it off) and absl/TF info lines
# ("I0000 00:00:... file.cc:12] ..."). Warnings and errors are passed on.
_INFO_LINE = re.compile(r"^(INFO: |I\d{4} \d\d:\d\d:\d\d)")


def partition_bytes(part) -> int:
    """The input bytes a :class:`clients.partitions.Partition` covers (its share of the bar)."""
    size = Path(part.path).stat().st_size
    if part.kind == "parquet":
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(part.path).metadata
        rows = sum(meta.row_group(g).num_rows for g in range(part.start, part.stop))
        return round(size * rows / meta.num_rows) if meta.num_rows else 0
    if part.stop < 0:  # a whole (.gz) file
        return size
    return part.stop - part.start


class Progress:
    """A tqdm bar in bytes, over every partition of a run; ``rows`` and rows/s as its postfix.

    Args:
        parts: the run's partitions (their bytes make the total).
        enabled: False draws nothing (the counts are still kept).
    """

    def __init__(self, parts: list, enabled: bool = True):
        from tqdm import tqdm

        self._share = {p.index: partition_bytes(p) for p in parts}
        self._counted = dict.fromkeys(self._share, 0)
        self.rows = 0
        self._started = time.perf_counter()
        self.bar = tqdm(total=self.total, unit="B", unit_scale=True, unit_divisor=1024,
                        disable=not enabled, file=sys.stderr, dynamic_ncols=True, smoothing=0.1)

    @property
    def total(self) -> int:
        return sum(self._share.values())

    @property
    def done(self) -> int:
        """Bytes counted so far (kept with the bar disabled too)."""
        return sum(self._counted.values())

    def chunk(self, part, rows: int, input_bytes: int) -> None:
        """A chunk of ``part`` was scored: ``rows`` rows read from ``input_bytes`` bytes."""
        step = max(0, min(input_bytes, self._share[part.index] - self._counted[part.index]))
        self._counted[part.index] += step
        self.rows += rows
        elapsed = time.perf_counter() - self._started
        self.bar.set_postfix_str(f"{self.rows:,} rows, {self.rows / elapsed if elapsed else 0:,.0f} rows/s",
                                 refresh=False)
        self.bar.update(step)

    def part_done(self, part, rows: int = 0) -> None:
        """``part`` is complete (``rows`` more rows, when its chunks were not reported one by one)."""
        self.chunk(part, rows, self._share[part.index] - self._counted[part.index])

    def close(self) -> None:
        self.bar.close()


@contextlib.contextmanager
def native_info_quieted() -> Iterator[None]:
    """Hold what C++ code writes to stderr (fd 2) while the block runs, then pass on everything
    but its info lines. For loading and warming up the frameworks, before the bar is drawn."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().decode(errors="replace").splitlines(keepends=True)
                    if not _INFO_LINE.match(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
