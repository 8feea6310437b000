"""The ranker's chain in C (ensemble/native/_chain.c, what the native backend scores plain calls with)
against the Python chain on the real exported release: the same outputs to the bit, from Triton's raw
buffers, whole or in parts; and its transform is numpy's float32 arithmetic on any value."""

from __future__ import annotations

import numpy as np
import pytest

from ensemble import schema
from ensemble import native
from ensemble.scoring import pipeline as runtime
from tests.helpers import fresh_rows


def _parts(dense: np.ndarray, cats: np.ndarray, sizes: list[int]) -> tuple:
    bounds = np.cumsum([0, *sizes])
    return tuple((np.ascontiguousarray(dense[a:b], np.float32).tobytes(), native.join_wire(cats[a:b].reshape(-1).tolist()),
                  int(b - a)) for a, b in zip(bounds, bounds[1:]))


@pytest.fixture(scope="module")
def one_thread(pipeline):
    alone = runtime.Pipeline(pipeline.steps, parallel=False, widths=pipeline.widths)
    yield alone
    alone.close()


def test_the_chain_in_c_is_built_here_and_passes_its_check(pipeline):
    assert native.COMPILED and pipeline.c_chain is not None


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("sizes", [[1], [7], [1, 1, 1, 1], [3, 40, 2], [16, 17], [33], [308], [0, 5, 0], [0, 40, 0]])
def test_the_chain_in_c_scores_what_the_pipeline_scores(pipeline, one_thread, sizes, threads):
    """On two threads the rows are cut in two, inside a request or between two (the cut at 16 rows)."""
    dense, cats = fresh_rows(max(sum(sizes) - 8, 1), seed=sum(sizes) + 40)  # with unseen values and edge cases
    dense, cats = dense[-sum(sizes):] if sum(sizes) else dense[:0], cats[-sum(sizes):] if sum(sizes) else cats[:0]
    out = np.full((len(schema.RANKER_OUTPUTS), sum(sizes)), -1, np.float32)
    pipeline.c_chain.score(_parts(dense, cats, sizes), out, threads)
    for reference in (pipeline, one_thread):  # two threads and one
        want = reference.score(dense, cats)
        for k, tensor in enumerate(schema.RANKER_OUTPUTS):
            assert np.array_equal(out[k], want[tensor.name].reshape(-1)), (sizes, tensor.name)


def test_the_dense_transform_in_c_is_numpys_to_the_bit(pipeline):
    transform = pipeline.reads_wire
    width = pipeline.widths.dense
    rng = np.random.default_rng(5)
    values = np.concatenate([
        np.arange(0, 1 << 20, dtype=np.float32),  # every count a real row has, and more
        rng.integers(0, 2**32, 1 << 21, dtype=np.uint64).astype(np.uint32).view(np.float32),  # any bit pattern
        np.array([np.nan, np.inf, -np.inf, -0.0, 1e-45, -1e-45, 3.4e38, -3.4e38], np.float32)])
    values = np.resize(values, (len(values) + width - 1) // width * width).reshape(-1, width)
    out = np.empty_like(values)
    pipeline.c_chain.transform_dense(values.tobytes(), out)
    assert np.array_equal(out, transform.transform_dense(values))


def test_the_chain_in_c_refuses_what_does_not_add_up(pipeline):
    dense, cats = fresh_rows(3, seed=9)
    (d, wire, rows), = _parts(dense[:3], cats[:3], [3])
    out = np.empty((len(schema.RANKER_OUTPUTS), 3), np.float32)
    with pytest.raises(ValueError, match="truncated"):
        pipeline.c_chain.score(((d, wire[:-1], rows),), out)
    big = _parts(*fresh_rows(40, seed=10), [48])  # on two threads: the helper's part fails
    (bd, bwire, brows), = big
    with pytest.raises(ValueError, match="truncated"):
        pipeline.c_chain.score(((bd, bwire[:-1], brows),), np.empty((len(schema.RANKER_OUTPUTS), 48), np.float32), 2)
    pipeline.c_chain.score(big, np.empty((len(schema.RANKER_OUTPUTS), 48), np.float32), 2)  # and it recovers
    with pytest.raises(ValueError, match="values in the BYTES tensor"):
        pipeline.c_chain.score(((d, wire + native.join_wire([b"x"]), rows),), out)
    with pytest.raises(ValueError, match="dense"):
        pipeline.c_chain.score(((d[:-4], wire, rows),), out)
    with pytest.raises(ValueError, match="out"):
        pipeline.c_chain.score(((d, wire, rows),), out[:, :2].copy())


def test_a_chain_in_c_that_disagrees_is_not_used(pipeline, monkeypatch, caplog):
    off = runtime.Pipeline(pipeline.steps, parallel=False, widths=pipeline.widths)
    chain_scores = runtime.Pipeline.chain_scores

    def one_ulp_off(self, dense, ids):
        out = chain_scores(self, dense, ids)
        out[-1] = np.nextafter(out[-1], np.float32(1))
        return out

    monkeypatch.setattr(runtime.Pipeline, "chain_scores", one_ulp_off)
    with caplog.at_level("WARNING"):
        assert off.c_chain is None
    assert "does not give the Python chain's scores" in caplog.text
    off.close()


def test_every_module_offers_its_c_entry_points_under_the_headers_version():
    """The tables of C entry points carry the version of ensemble/native/api.h in their names: a backend
    built against another version (a release folder's copy from an earlier install) finds none and
    scores through Python, instead of calling through a table of another shape."""
    import ctypes
    import importlib
    import re
    from pathlib import Path

    header = (Path(__file__).resolve().parents[2] / "ensemble" / "native" / "api.h").read_text()
    version = re.search(r'#define ENSEMBLE_API_VERSION "(\d+)"', header).group(1)
    is_valid = ctypes.pythonapi.PyCapsule_IsValid
    is_valid.argtypes, is_valid.restype = (ctypes.py_object, ctypes.c_char_p), ctypes.c_int
    from tests.fuzz.sanitize import MODULES  # every C module of the project

    for name in MODULES:
        module = importlib.import_module(name)
        assert [a for a in dir(module) if a.startswith("_C_API")] == [f"_C_API_{version}"], name
        assert is_valid(getattr(module, f"_C_API_{version}"), f"{name}._C_API_{version}".encode()), name
