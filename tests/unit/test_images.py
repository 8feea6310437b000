"""What the images, the compose file and the Kubernetes manifests run, run here (no Docker engine).

The package is built as the images build it (``pip install --no-deps .``: an isolated build of a
wheel) and installed into a folder of its own; every Python step of a Dockerfile (``python -c``,
a copied script) runs against that install, every module a manifest or the compose file runs
(``python -m M``, ``locust -f F``, the ``ensemble`` entry point) is imported from it, and every
``ensemble ...`` command line they give is parsed by the command line's own parser. A step that
names a module that moved, or a file the wheel does not carry, fails here.
"""

from __future__ import annotations

import ast
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").rglob("*.yaml"))
PYTHONS = {"python", "python3", ".venv/bin/python", "/usr/bin/python3.11"}
# Steps that install rather than run: the test's own wheel install stands for them.
INSTALLS = (("-m", "pip"), ("-m", "venv"))


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The package as `pip install --no-deps .` installs it: an isolated build, into a folder of its own."""
    root = tmp_path_factory.mktemp("image")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "--disable-pip-version-check",
                            str(ROOT), "-w", str(root / "wheel")], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = next((root / "wheel").glob("ensemble-*.whl"))
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--disable-pip-version-check",
                           "--target", str(root / "site"), str(wheel)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "site"


def _run(installed: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """This interpreter, with the installed package first on the path and outside the checkout."""
    env = {**os.environ, "PYTHONPATH": str(installed), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          cwd=cwd or installed.parent, timeout=600)


def _imports(code: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append(node.module)
    return found


def _instructions(path: Path):
    from tests.helpers import dockerfile_instructions  # in a child process: see there

    return dockerfile_instructions(path)


def _python_steps(path: Path) -> list[list[str]]:
    """Every python invocation in the Dockerfile's RUN instructions (a `&&` chain split), as argv."""
    steps = []
    for instruction in _instructions(path):
        if instruction.cmd.lower() != "run":
            continue
        for part in " ".join(instruction.value).split("&&"):
            argv = shlex.split(part.strip())
            if argv and argv[0] in PYTHONS and tuple(argv[1:3]) not in INSTALLS:
                steps.append(argv)
    return steps


def _copied(path: Path) -> dict[str, Path]:
    """Image path -> the build context's file, for every COPY of a single file."""
    found = {}
    for instruction in _instructions(path):
        if instruction.cmd.lower() == "copy" and not any(v.startswith("--from") for v in instruction.value):
            values = [v for v in instruction.value if not v.startswith("--")]
            for source in values[:-1]:
                found[values[-1] if not values[-1].endswith("/") else values[-1] + Path(source).name] = ROOT / source
    return found


def test_the_installed_package_is_what_the_steps_import(installed):
    done = _run(installed, "-c", "import ensemble, ensemble.dataset as d; print(ensemble.__file__); "
                                 "print(sorted(p.name for p in d.BUILTIN_DIR.glob('*.toml')))")
    assert done.returncode == 0, done.stderr
    where, specs = done.stdout.splitlines()
    assert where.startswith(str(installed)), where  # not the checkout's editable install
    assert specs == str(sorted(p.name for p in (ROOT / "ensemble" / "datasets").glob("*.toml")))


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_every_python_step_of_the_dockerfile_runs_against_the_installed_package(path, installed):
    copied = _copied(path)
    ran = 0
    for argv in _python_steps(path):
        args = argv[1:]
        if args[0] == "-c":
            for module in _imports(args[1]):  # the modules it names exist in the install
                found = _run(installed, "-c", f"import importlib; importlib.import_module({module!r})")
                assert found.returncode == 0, f"{path.name}: {module}: {found.stderr[-2000:]}"
        elif args[0] in copied:
            args = [str(copied[args[0]]), *args[1:]]
        elif args[0] == "-m":
            pass
        else:
            pytest.fail(f"{path.name}: a python step this test does not know how to run: {argv}")
        done = _run(installed, *args)
        if "--torch" in args and args[args.index("--torch") + 1] == "cuda":  # no CUDA torch on a CPU machine
            assert done.returncode == 1 and "a CPU build, expected cuda" in done.stdout + done.stderr, done.stdout
        else:
            assert done.returncode == 0, f"{path.name}: {' '.join(argv)}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        ran += 1
    assert ran or path.name == "cpu.Dockerfile" and "make setup" in path.read_text()


def _ensemble_calls(script: str, env: dict[str, str], tmp_path: Path) -> list[list[str]]:
    """A compose service's shell script run with `ensemble` replaced by a function logging its argv."""
    log = tmp_path / "calls.txt"
    log.unlink(missing_ok=True)
    prelude = f'ensemble() {{ for a in "$@"; do printf "%s\\0" "$a"; done >> {log}; echo >> {log}; }}; '
    done = subprocess.run(["/bin/sh", "-c", prelude + script.replace("$$", "$")], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", **env})
    assert done.returncode == 0, done.stderr
    text = log.read_text() if log.exists() else ""
    return [[a for a in line.split("\0") if a] for line in text.split("\n") if line]


def _commands() -> list[tuple[str, str, list[str], dict[str, str]]]:
    """(where, program, argv, environment) for every command the compose file and the manifests give a container."""
    found = []
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name, service in compose["services"].items():
        command = service.get("command")
        if command is None or "build" not in service:  # an image of another project's (Prometheus, Grafana)
            continue
        entry = service.get("entrypoint") or _entrypoint(ROOT / service["build"]["dockerfile"]) if "build" in service else None
        argv = [*(entry or []), *command]
        env = {k: str(v) for k, v in (service.get("environment") or {}).items()} \
            if isinstance(service.get("environment"), dict) else {}
        found.append((f"docker-compose.yml {name}", argv[0], argv[1:], env))
        test = (service.get("healthcheck") or {}).get("test") or []
        if test[:1] == ["CMD"]:
            found.append((f"docker-compose.yml {name} healthcheck", test[1], test[2:], {}))
    for path in MANIFESTS:
        for document in yaml.safe_load_all(path.read_text()):
            for container in _containers(document):
                where = f"{path.relative_to(ROOT)} {container.get('name')}"
                if container.get("command"):
                    found.append((where, container["command"][0], container["command"][1:] + container.get("args", []), {}))
                elif container.get("args") and str(container.get("image", "")).startswith("ensemble"):
                    found.append((where, "ensemble", container["args"], {}))
                hook = ((container.get("lifecycle") or {}).get("preStop") or {}).get("exec", {}).get("command", [])
                if hook:
                    found.append((f"{where} preStop", hook[0], hook[1:], {}))
    return found


def _entrypoint(path: Path) -> list[str] | None:
    """The Dockerfile's ENTRYPOINT (exec form), or None."""
    import json

    for instruction in _instructions(path):
        if instruction.cmd.lower() == "entrypoint":
            return json.loads(instruction.original.split(None, 1)[1])
    return None


def _containers(node) -> list[dict]:
    if isinstance(node, dict):
        found = [c for c in node.get("containers", []) if isinstance(c, dict)] if isinstance(node.get("containers"), list) else []
        for value in node.values():
            found += _containers(value)
        return found
    if isinstance(node, list):
        return [c for item in node for c in _containers(item)]
    return []


def test_every_command_the_compose_file_and_the_manifests_run_exists(installed, tmp_path):
    from ensemble.cli import build_parser

    parser = build_parser()
    checked = {"ensemble": 0, "python": 0, "locust": 0}
    for where, program, argv, env in _commands():
        if program in ("/bin/sh", "sh", "/bin/bash", "bash") and argv[:1] == ["-c"]:
            program, calls = "ensemble", _ensemble_calls(argv[1], env, tmp_path)
            assert calls, f"{where}: a shell script that runs no ensemble command"
        else:
            calls = [argv]
        if program == "ensemble":
            for call in calls:
                try:
                    parser.parse_args(call)
                except SystemExit:
                    pytest.fail(f"{where}: `ensemble {' '.join(call)}` is not a command line ensemble accepts")
                checked["ensemble"] += 1
        elif program in PYTHONS:
            if argv[0] == "-m":
                done = _run(installed, "-c", f"import importlib; importlib.import_module({argv[1]!r})")
            else:
                assert argv[0] == "-c", f"{where}: {argv}"
                done = _run(installed, "-c", "; ".join(f"import {m}" for m in _imports(argv[1])) or "pass")
            assert done.returncode == 0, f"{where}: {argv}: {done.stderr[-2000:]}"
            checked["python"] += 1
        elif program in ("tritonserver", "envoy", "sleep"):
            continue  # not this project's code: the servers' own flags are checked by test_compose and test_kubernetes
        elif program == "locust":
            locustfile = argv[argv.index("-f") + 1]
            user = argv[-1]
            code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('locustfile', "
                    f"{str(ROOT / locustfile)!r}); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
                    f"assert hasattr(m, {user!r}), 'no user class {user}'")
            done = _run(installed, "-c", code, cwd=ROOT)
            assert done.returncode == 0, f"{where}: {done.stderr[-2000:]}"
            checked["locust"] += 1
        else:
            pytest.fail(f"{where}: a program this test does not know: {program} {argv}")
    # the trainers, the CPU server, the baseline, the export job, the KServe runtime and the gateway's hook
    assert checked["ensemble"] >= 8 and checked["python"] >= 2 and checked["locust"] == 2, checked


def test_the_entry_point_resolves_in_the_installed_package(installed):
    done = _run(installed, "-c", "from importlib.metadata import entry_points; import ensemble.cli as c; "
                                 "assert callable(c.main)")
    assert done.returncode == 0, done.stderr
