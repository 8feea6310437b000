"""The native backend says what it does through an exported function, and the operator's side asks it (shadow
scoring, the C entry points' version) instead of searching the library's bytes."""

from __future__ import annotations

import shutil

import pytest

from ensemble.native import backend


def _library():
    try:
        return backend.library()
    except backend.NotBuilt as exc:
        pytest.skip(str(exc))


def test_the_built_backend_states_its_api_and_features():
    said = backend.capabilities(_library())
    assert said.api == backend.installed_api() and said.api is not None
    assert {"shadow", "tables"} <= said.features


def test_a_library_that_says_nothing_has_no_capabilities(tmp_path):
    from ensemble.native import _trees  # a library of this machine without the symbol

    said = backend.capabilities(shutil.copy(_trees.__file__, tmp_path / "libtriton_native.so"))
    assert said == backend.Capabilities(None, frozenset())
    with pytest.raises(OSError):
        backend.capabilities(tmp_path / "missing.so")
    (tmp_path / "text.so").write_text("not a library, though it names ensemble_shadow_score_difference")
    with pytest.raises(OSError):
        backend.capabilities(tmp_path / "text.so")


def test_shadow_scoring_is_refused_for_a_backend_that_does_not_say_it_shadows(tmp_path):
    from ensemble.fleet import experiment
    from ensemble.models.registry import Layout

    release = tmp_path / "ranker" / "3"
    release.mkdir(parents=True)
    (release / backend.FILE_NAME).write_bytes(b"\0ensemble_shadow_score_difference\0")  # the old check passed this
    fleet = type("Fleet", (), {"layout": Layout.NATIVE.value, "repository": str(tmp_path)})()
    with pytest.raises(experiment.DeployError, match="built before shadow scoring"):
        experiment._check_shadow(fleet, 3)
    shutil.copy(_library(), release / backend.FILE_NAME)
    experiment._check_shadow(fleet, 3)  # the real library says it shadows
