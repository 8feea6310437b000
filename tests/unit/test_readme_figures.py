"""The README's demo figures are regenerated from the demo's summary and compared with it."""

from ensemble.runs import readme_figures

SUMMARY = {
    "machine": "x86_64, 2 cores (AMD EPYC), 24 GiB, no GPU",
    "accuracy": {name: {"auc": 0.7 + i / 100, "logloss": 0.5 - i / 100}
                 for i, name in enumerate(("xgb", "dlrm_torch", "dlrm_tf", "blend"))},
    "example": {"row": 1535, "score": 0.30512, "score_c4_unseen": 0.3612},
    "latency": {f"{p}_{r}rows": {"p50_ms": 1.0 + r / 100, "p99_ms": 2.0 + r / 100, "n": 300}
                for p in ("http", "grpc") for r in (1, 100)},
    "parity_max_abs_diff": {"score": 0.0, "score_xgb": 1e-7},
    "parity_rows": 2008,
    "server_rss_mib": 401.2,
}
README = """# title

<!-- figures:accuracy -->
stale table
<!-- /figures:accuracy -->

text between

<!-- figures:example -->
<!-- /figures:example -->

<!-- figures:demo -->
old timings
<!-- /figures:demo -->
"""


def test_write_fills_every_block_and_keeps_the_rest():
    written = readme_figures.rewrite(README, readme_figures.render(SUMMARY))
    assert "| blend | 0.7300 | 0.4700 |" in written and "stale table" not in written
    assert "scores 0.305; with C4 replaced by an unseen value, 0.361" in written
    assert "| 100-row request | 2.00 / 3.00 ms | 2.00 / 3.00 ms |" in written and "old timings" not in written
    assert written.startswith("# title\n") and "text between" in written
    assert readme_figures.rewrite(written, readme_figures.render(SUMMARY)) == written  # idempotent


def test_check_compares_the_deterministic_figures_only():
    assert readme_figures.stale(README, SUMMARY) == ["accuracy", "example"]
    written = readme_figures.rewrite(README, readme_figures.render(SUMMARY))
    assert readme_figures.stale(written, SUMMARY) == []
    slower = {**SUMMARY, "latency": {k: {**v, "p99_ms": 9.0} for k, v in SUMMARY["latency"].items()}}
    assert readme_figures.stale(written, slower) == []  # timings differ run to run: not compared
    other = {**SUMMARY, "example": {**SUMMARY["example"], "score": 0.31}}
    assert readme_figures.stale(written, other) == ["example"]


def test_the_real_readme_has_every_block():
    assert set(readme_figures.current(readme_figures.README.read_text())) == {"accuracy", "example", "demo"}


def test_the_check_compares_at_the_readmes_precision_and_not_the_machine():
    written = readme_figures.rewrite(README, readme_figures.render(SUMMARY))
    elsewhere = {**SUMMARY, "machine": "x86_64, 2 cores (Intel Xeon (family 6 model 143; avx512f amx_tile)), 24 GiB, no GPU",
                 "example": {**SUMMARY["example"], "score": 0.30538}}  # 0.305 at the README's three decimals
    assert readme_figures.stale(written, elsewhere) == []
    assert readme_figures.verdict(written, elsewhere) == "README figures match this build"
    off = {**elsewhere, "example": {**SUMMARY["example"], "score": 0.3074},
           "accuracy": {**SUMMARY["accuracy"], "blend": {"auc": 0.7321, "logloss": 0.47}}}
    line = readme_figures.verdict(written, off)
    assert readme_figures.stale(written, off) == ["accuracy", "example"]
    assert "by up to 0.0021 in accuracy, 0.002 in example" in line and "AMD EPYC" in line and "Intel Xeon" in line
