"""The C build: warnings are errors in the project's own checks only, a missing module is said, and
the build requirements agree with requirements.txt (an isolated build builds every module:
tests/unit/test_images.py installs one)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

from ensemble.native import built

ROOT = Path(__file__).resolve().parents[2]
SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")
# A warning the project's flags do not ask for, which the project's C does trigger: what a user's newer
# compiler might add on its own.
NEW_WARNING = "-Wconversion"


def _build(tmp_path: Path, strict: bool, cflags: str = "") -> tuple[subprocess.CompletedProcess, set[str]]:
    env = {k: v for k, v in os.environ.items() if k not in ("ENSEMBLE_C_STRICT", "CFLAGS")}
    env.update({"ENSEMBLE_C_STRICT": "1" if strict else "0", "CFLAGS": cflags})
    done = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--force", "--build-lib", str(tmp_path / "lib"),
                           "--build-temp", str(tmp_path / "tmp")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    names = {p.name.removesuffix(SUFFIX) for p in (tmp_path / "lib" / "ensemble" / "native").glob(f"*{SUFFIX}")}
    return done, names


EVERY = {*built.MODULES, "libtriton_native"}


def test_the_projects_strict_build_builds_every_module_without_a_warning(tmp_path):
    done, names = _build(tmp_path, strict=True)
    assert done.returncode == 0 and names == EVERY, done.stderr[-3000:]
    assert "warning:" not in done.stderr, done.stderr[-3000:]


def test_a_new_warning_fails_the_strict_build_but_costs_a_user_nothing(tmp_path):
    done, names = _build(tmp_path / "user", strict=False, cflags=NEW_WARNING)
    assert done.returncode == 0 and names == EVERY, done.stderr[-3000:]
    assert "warning:" in done.stderr  # the compiler's own lines still show
    done, _ = _build(tmp_path / "ci", strict=True, cflags=NEW_WARNING)
    assert done.returncode != 0 and "error:" in done.stderr


def test_a_module_that_does_not_compile_is_named_and_the_rest_build(tmp_path):
    done, names = _build(tmp_path, strict=False, cflags="-DENSEMBLE_BUILD_PROBE -include /nonexistent/header.h")
    assert done.returncode == 0 and names == set(), done.stderr[-2000:]  # nothing compiles, the install stands
    assert all(f"the C module ensemble.native.{m} was not built" in done.stderr for m in built.MODULES), done.stderr[-3000:]


def test_a_missing_module_is_said_with_what_serves_instead(tmp_path):
    copy = tmp_path / "ensemble"
    shutil.copytree(ROOT / "ensemble", copy, ignore=shutil.ignore_patterns("__pycache__"))
    for module in ("_chain", "_trees"):
        for found in (copy / "native").glob(f"{module}{SUFFIX}"):
            found.unlink()
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "ensemble.native"], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr  # a user's install: said, not fatal
    assert "ensemble.native._chain is not built: every request goes through the model's Python execute" in done.stderr
    assert "ensemble.native._trees is not built: XGBoost scores the trees" in done.stderr
    assert f"{len(EVERY) - 2} of {len(EVERY)} C modules built" in done.stderr
    strict = subprocess.run([sys.executable, "-m", "ensemble.native", "--strict"], env=env, cwd=tmp_path,
                            capture_output=True, text=True)
    assert strict.returncode == 1


@pytest.mark.parametrize("name", ["numpy", "openvino"])
def test_the_build_requirements_are_requirements_txt_pins(name):
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    pinned = re.search(rf"^{name}==(\S+)$", (ROOT / "requirements.txt").read_text(), re.M).group(1)
    assert f"{name}=={pinned}" in requires
