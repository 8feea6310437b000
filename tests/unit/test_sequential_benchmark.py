"""benchmarks.sequential's table: the median and the range of the blocks' p50 and p99 per point."""

from benchmarks.sequential import table


def test_the_table_gives_each_points_median_and_range_over_blocks():
    results = [{"block": b, "protocol": proto, "rows": rows, "p50_ms": p50, "p99_ms": p50 * 2, "n": 300}
               for proto in ("http", "grpc") for rows in (1, 100)
               for b, p50 in enumerate((0.3, 0.5, 0.4) if rows == 1 else (1.0, 0.9, 1.2), start=1)]
    lines = table(results).splitlines()
    assert lines[2] == "| 1 row | http | 0.400 (0.300-0.500) | 0.80 (0.60-1.00) |"
    assert lines[3] == "| 100 rows | http | 1.000 (0.900-1.200) | 2.00 (1.80-2.40) |"
    assert [line.split(" | ")[1] for line in lines[2:]] == ["http", "http", "grpc", "grpc"]
