import math

import pytest

from loadtest.cost import Instance, cost_per_million, cost_table, load_prices, render
from loadtest.report import PRICES


def test_cost_formula():
    # $3.60/h at 1,000 predictions/s = 3.6M predictions/h -> $1 per million
    assert cost_per_million(3.6, 1000) == pytest.approx(1.0)
    assert cost_per_million(0.36, 10_000) == pytest.approx(0.01)
    assert math.isinf(cost_per_million(1.0, 0))


def test_shipped_price_file_has_the_seed_points():
    prices = load_prices(PRICES)
    assert prices["instances"]["e2-highmem-8"] == Instance("e2-highmem-8", 0.36, 8, 0, prices["instances"]["e2-highmem-8"].source)
    assert prices["instances"]["a2-highgpu-1g"].hourly_usd == 3.67
    assert prices["instances"]["a2-highgpu-1g"].gpus == 1


def test_table_labels_extrapolations_and_never_invents_gpu_figures():
    prices = {"instances": {"cpu8": Instance("cpu8", 0.36, 8), "gpu": Instance("gpu", 3.67, 12, 1)},
              "measured_machine": {"name": "here", "hourly_usd": 0.09}}
    results = {"server_vcpus": 1, "sla_ms": 10, "headline": [
        {"target": "triton-http", "rows": 100, "rows_per_s_at_sla": 5000.0},
        {"target": "naive", "rows": 100, "rows_per_s_at_sla": None}]}
    rows = {(r["target"], r["instance"]): r for r in cost_table(results, prices)}
    measured = rows[("triton-http", "here")]
    assert measured["basis"] == "measured"
    assert measured["usd_per_million"] == pytest.approx(0.09 / (5000 * 3600) * 1e6)
    extrapolated = rows[("triton-http", "cpu8")]
    assert extrapolated["basis"].startswith("extrapolated") and "8/1 vCPUs" in extrapolated["basis"]
    assert extrapolated["usd_per_million"] == pytest.approx(0.36 / (40_000 * 3600) * 1e6)
    assert rows[("triton-http", "gpu")]["usd_per_million"] is None
    assert "no GPU run" in rows[("triton-http", "gpu")]["basis"]
    assert rows[("naive", "-")]["usd_per_million"] is None
    assert "| triton-http | 100 | here | $0.0050 | measured |" in render(list(rows.values()))
