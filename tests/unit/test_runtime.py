"""Serving-side helpers that need no server: the BYTES deserializer and releases."""

import importlib.util
import json
import shutil

import numpy as np
import pytest

from clients.wire import serialize_bytes
from ensemble import schema
from ensemble.scoring import pipeline as runtime
from ensemble.schema import Model


def _triton_utils():
    """Triton's own triton_python_backend_utils, as shipped in the nvidia-pytriton wheel."""
    from ensemble.operate.server import find_tritonserver

    path = find_tritonserver().parent.parent / "backends" / "python" / "triton_python_backend_utils.py"
    spec = importlib.util.spec_from_file_location("triton_python_backend_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("values", [
    [b"68fd1e64", b"", b"x" * 5000, "\u00e9".encode(), b"\xff\xfe", b"  "],
    [b""] * 26,
    [],
])
def test_deserialize_bytes_matches_tritons_own(values):
    wire = serialize_bytes(np.array(values, dtype=object))
    ours = runtime.deserialize_bytes(np.frombuffer(wire, np.uint8))
    theirs = _triton_utils().deserialize_bytes_tensor(wire)
    assert ours.dtype == object and list(ours) == list(theirs) == values


def test_release_names_the_step_versions_exported_together(trained, tmp_path):
    from ensemble.repository.export import TrainedArtifacts, export_repository

    repo = tmp_path / "repo"
    shutil.copytree(trained.repository, repo)
    written = export_repository(TrainedArtifacts.under(trained.workdir), repo)
    release = written[Model.RANKER]
    versions = json.loads((release / runtime.RELEASE_FILE).read_text())["versions"]
    assert versions == {m.value: int(written[m].name) for m in written if m is not Model.RANKER}
    assert runtime.release_versions(repo) == {m: written[m] for m in written if m is not Model.RANKER}
    previous = runtime.release_versions(repo, int(release.name) - 1)
    assert all(int(folder.name) == int(written[m].name) - 1 for m, folder in previous.items())
    with pytest.raises(FileNotFoundError):
        runtime.release_versions(repo, 999)


def test_fused_step_scores_like_the_pipeline(trained, pipeline):
    from tests.helpers import fresh_rows

    release = runtime.latest_version(trained.repository / Model.RANKER.value)
    fused = runtime.load_fused(release)
    dense, cats = fresh_rows(300, seed=21)
    got = fused.run({"dense": dense, "categorical": cats})
    want = pipeline.score(dense, cats)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-6)


def test_wire_runner_scores_the_wire_buffer_like_the_fused_step(trained, pipeline):
    from ensemble import native
    from tests.helpers import fresh_rows

    fused = runtime.load_fused(runtime.latest_version(trained.repository / Model.RANKER.value))
    wire = runtime.wire_runner(fused)
    assert wire is not None and [t.dtype for t in wire.step.inputs] == [schema.DType.FP32, schema.DType.INT64]
    dense, cats = fresh_rows(300, seed=22)  # with missing values and unseen categories
    transform = fused.fn.reads_wire
    ids = transform.ids_from_wire(native.join_wire(list(cats.reshape(-1))), len(cats))
    assert np.array_equal(ids, transform.transform_categorical(cats))
    got = wire.run({"dense": dense, "categorical": ids})
    want = fused.run({"dense": dense, "categorical": cats})
    for name in want:
        assert np.array_equal(got[name], want[name]), name


def test_a_hashed_column_is_hashed_from_the_wire_and_a_multi_hot_one_has_no_wire_runner(trained):
    import dataclasses

    from ensemble import native

    fused = runtime.load_fused(runtime.latest_version(trained.repository / Model.RANKER.value))
    features = fused.fn.steps[Model.FEATURES]
    hashed = dataclasses.replace(features.fn, hash_buckets=(0,) * (len(features.fn.lookups) - 1) + (16,))
    cats = np.array([[f"v{r}-{c}".encode() for c in range(len(hashed.lookups))] for r in range(7)], dtype=object)
    from_wire = hashed.ids_from_wire(native.join_wire(cats.reshape(-1).tolist()), 7)
    assert np.array_equal(from_wire, hashed.transform_categorical(cats))  # C from the buffer == Python
    assert from_wire[:, -1].tolist() == [native.hash_ids([f"v{r}-{len(hashed.lookups) - 1}".encode()], 16)[0]
                                         for r in range(7)]
    multi = dataclasses.replace(features.fn, max_items=(0,) * (len(features.fn.lookups) - 1) + (2,))
    steps = {**fused.fn.steps, Model.FEATURES: runtime.StepRunner(features.step, multi)}
    pipeline = runtime.Pipeline(steps, widths=fused.fn.widths)
    assert pipeline.reads_wire is None
    assert runtime.wire_runner(runtime.StepRunner(fused.step, pipeline)) is None
    with pytest.raises(ValueError, match="multi-hot"):
        multi.ids_from_wire(b"", 0)


@pytest.mark.parametrize("rows", [33, 300])
def test_rows_split_over_two_threads_score_as_one_thread_does(pipeline, rows):
    from tests.helpers import fresh_rows

    dense, cats = fresh_rows(rows, seed=23)  # and the edge-case rows
    split = runtime.Pipeline(pipeline.steps, parallel=True, widths=pipeline.widths)
    alone = runtime.Pipeline(pipeline.steps, parallel=False, widths=pipeline.widths)
    got, want = split.score(dense, cats), alone.score(dense, cats)
    assert split._pool is not None  # the worker thread scored the second half
    for name in want:
        assert got[name].shape == want[name].shape == (len(dense), 1)
        assert np.array_equal(got[name], want[name]), name
    split.close()


@pytest.mark.parametrize("parallel", [False, True])
def test_kernel_chain_scores_as_the_steps_do(pipeline, parallel):
    from tests.helpers import fresh_rows

    chained = runtime.Pipeline(pipeline.steps, parallel=parallel, widths=pipeline.widths)
    steps = runtime.Pipeline(pipeline.steps, parallel=parallel, widths=pipeline.widths, chain=False)
    assert chained.kernel_chain is not None and steps.kernel_chain is None
    dense, cats = fresh_rows(300, seed=24)  # with missing values, unseen categories and the edge-case rows
    for rows in (0, 1, 7, 33, len(dense)):
        got, want = chained.score(dense[:rows], cats[:rows]), steps.score(dense[:rows], cats[:rows])
        assert list(got) == list(want) == [t.name for t in schema.RANKER_OUTPUTS]
        for name in want:
            assert got[name].shape == want[name].shape == (rows, 1) and got[name].dtype == np.float32
            assert np.array_equal(got[name], want[name]), (rows, name)
    chained.close()
    steps.close()


def test_no_kernel_chain_when_a_model_scores_without_its_kernel(pipeline):
    from tests.helpers import fresh_rows

    torch_step = pipeline.steps[Model.DLRM_TORCH]
    framework = runtime.StepRunner(torch_step.step, torch_step.fn.framework)  # TorchScript's own forward pass
    mixed = runtime.Pipeline({**pipeline.steps, Model.DLRM_TORCH: framework}, parallel=False, widths=pipeline.widths)
    assert mixed.kernel_chain is None
    dense, cats = fresh_rows(50, seed=25)
    got, want = mixed.score(dense, cats), pipeline.score(dense, cats)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-5)


def test_a_kernel_chain_that_disagrees_with_the_steps_is_not_used(pipeline, monkeypatch, caplog):
    from ensemble.scoring import chain

    scores = chain.KernelChain.__call__

    def one_ulp_off(self, dense_features, category_ids):
        out = scores(self, dense_features, category_ids)
        out[schema.SCORE.name] = np.nextafter(out[schema.SCORE.name], np.float32(1))
        return out

    monkeypatch.setattr(chain.KernelChain, "__call__", one_ulp_off)
    off = runtime.Pipeline(pipeline.steps, parallel=False, widths=pipeline.widths)
    with caplog.at_level("WARNING"):
        assert off.kernel_chain is None
    assert "differ from the steps'" in caplog.text
