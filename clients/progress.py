"""What `ensemble score` shows while it runs: a progress bar over the input's bytes (known before
the run, so the bar has a total and an ETA) with rows and rows/s beside it (framework log lines are
kept off the terminal while the bar is drawn: :mod:`ensemble.base.console`).

Rows are not known before a TSV file is read to its end; bytes are: a plain TSV partition is a
byte range, a .gz file counts its compressed size (read position of the compressed stream), and
a Parquet row group its share of the file by rows.
"""

from __future__ import annotations


import sys
import time
from pathlib import Path

# DataFrame.attrs key: how many input bytes a chunk was read from (set by read_partition).
INPUT_BYTES = "input_bytes"

def partition_bytes(part) -> int:
    """The input bytes a :class:`clients.batch.input.Partition` covers (its share of the bar)."""
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
        enabled: False draws nothing (the counts are still kept). Nor is anything drawn when
            stderr is not a terminal: in a log file each redraw is another copy of the bar.
    """

    def __init__(self, parts: list, enabled: bool = True):
        from tqdm import tqdm

        self._share = {p.index: partition_bytes(p) for p in parts}
        self._counted = dict.fromkeys(self._share, 0)
        self.rows = 0
        self._started = time.perf_counter()
        self.bar = tqdm(total=self.total, unit="B", unit_scale=True, unit_divisor=1024,
                        disable=not enabled or not sys.stderr.isatty(), file=sys.stderr, dynamic_ncols=True,
                        smoothing=0.1)

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
