"""Serving-side helpers that need no server: the BYTES deserializer and releases."""

import importlib.util
import json
import shutil

import numpy as np
import pytest

from clients.wire import serialize_bytes
from ensemble.serving import runtime
from ensemble.schema import Model


def _triton_utils():
    """Triton's own triton_python_backend_utils, as shipped in the nvidia-pytriton wheel."""
    from ensemble.serving.server import find_tritonserver

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
