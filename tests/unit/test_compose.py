"""docker-compose.yml and the Dockerfiles, checked statically (no Docker engine on these machines).

The compose file is validated against the Compose Specification's JSON schema (the copy that
check-jsonschema vendors); the Dockerfiles are parsed with BuildKit's own parser (the
`dockerfile` package) and linted with hadolint; the rest checks that they say what they do.
"""

import fnmatch
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ensemble.repository import configs
from tests.helpers import dockerfile_instructions
from ensemble.models import triton_releases

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))


def _validate(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                           str(path)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_file_matches_the_compose_specification():
    done = _validate(COMPOSE)
    assert done.returncode == 0, done.stdout + done.stderr


def test_schema_validation_is_strict(tmp_path, compose):
    broken = dict(compose, services=dict(compose["services"]))
    broken["services"]["triton"] = dict(compose["services"]["triton"], helthcheck={"test": ["CMD", "true"]})
    path = tmp_path / "compose.yml"
    path.write_text(yaml.safe_dump(broken))
    done = _validate(path)
    assert done.returncode != 0 and "helthcheck" in done.stdout + done.stderr


def test_services_and_profiles(compose):
    services = compose["services"]
    profiles = {name: tuple(s.get("profiles", ())) for name, s in services.items()}
    assert profiles == {"trainer": ("gpu",), "trainer-tf": ("gpu",), "triton": ("gpu",), "trainer-cpu": ("cpu",),
                        "triton-cpu": ("cpu",), "naive": (), "locust-master": (), "locust-worker": (), "prometheus": (),
                        "grafana": ()}


def _gpu_reserved(service: dict) -> bool:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices)


def test_triton_service(compose):
    triton = compose["services"]["triton"]
    assert triton["build"]["dockerfile"] == "docker/triton.Dockerfile"
    assert triton["command"][0] == "tritonserver"
    assert f"--model-config-name={configs.GPU_CONFIG_NAME}" in triton["command"]
    assert "--model-repository=/models" in triton["command"]
    assert _mount(triton, "model-repository") == ("/models", False)  # see test_triton_repository_is_writable
    assert _gpu_reserved(triton)
    assert "/v2/health/ready" in " ".join(triton["healthcheck"]["test"])
    assert triton["depends_on"] == {"trainer-tf": {"condition": "service_completed_successfully"}}


def _mount(service: dict, volume: str) -> tuple[str, bool]:
    """(target, read_only) of a named volume in a service, short or long compose syntax."""
    for entry in service.get("volumes", []):
        if isinstance(entry, str):
            source, target, *mode = entry.split(":")
            if source == volume:
                return target, "ro" in ",".join(mode).split(",")
        elif entry.get("source") == volume:
            return entry["target"], bool(entry.get("read_only", False))
    raise AssertionError(f"volume {volume} is not mounted")


def test_triton_repository_is_writable(compose):
    """FIL (r25.02 src/tl_utils.h) opens checkpoint.tl with a default-mode std::fstream: O_RDWR,
    which a read-only mount refuses even to root. A read-only repository fails `xgb`, so `ranker`."""
    triton = compose["services"]["triton"]
    target, read_only = _mount(triton, "model-repository")
    assert target == "/models" and not read_only, "triton's repository must not be mounted read-only (FIL)"
    assert not triton.get("read_only", False)
    text = COMPOSE.read_text()
    assert "src/tl_utils.h" in text[:text.index("model-repository:/models\n    shm_size")], "say why it is writable"


def test_mount_reader_sees_read_only_forms():
    service = {"volumes": ["model-repository:/models:ro", {"type": "volume", "source": "data", "target": "/d",
                                                            "read_only": True}]}
    assert _mount(service, "model-repository") == ("/models", True) and _mount(service, "data") == ("/d", True)


def _run_script(script: str, tmp_path: Path, **env: str) -> list[str]:
    """Run a service's shell script with `ensemble` replaced by a function that logs its argv."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "calls.txt"
    prelude = f'ensemble() {{ echo "$*" >> {log}; }}; '
    done = subprocess.run(["/bin/sh", "-c", prelude + script.replace("$$", "$")], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", **env})
    assert done.returncode == 0, done.stderr
    return log.read_text().splitlines() if log.exists() else []


def test_gpu_training_runs_in_two_stages_then_exports_and_checks(compose, tmp_path):
    """torch (CUDA 13 wheels) and TensorFlow (CUDA 12 wheels) train in separate images."""
    services = compose["services"]
    trainer, trainer_tf = services["trainer"], services["trainer-tf"]
    assert trainer["build"]["dockerfile"] == "docker/trainer.Dockerfile"
    assert trainer_tf["build"]["dockerfile"] == "docker/trainer-tf.Dockerfile"
    for service in (trainer, trainer_tf):
        assert _gpu_reserved(service) and _mount(service, "model-repository") == ("/models", False)
        assert _mount(service, "data") == ("/data", False)
    assert trainer_tf["depends_on"] == {"trainer": {"condition": "service_completed_successfully"}}
    calls = _run_script(trainer["command"][0], tmp_path / "torch", **{k: str(v) for k, v in trainer["environment"].items()})
    assert calls[2] == "train /data/train.tsv --workdir /data/work --device gpu --models xgb,dlrm_torch"
    assert [c.split()[0] for c in calls] == ["synth", "synth", "train"]  # stops before export
    calls = _run_script(trainer_tf["command"][0], tmp_path / "tf")
    assert calls == ["train /data/train.tsv --workdir /data/work --device gpu --models dlrm_tf --reuse-features",
                     "export --workdir /data/work --repository /models",
                     "check --repository /models --target gpu"]


def test_cpu_training_is_one_stage(compose, tmp_path):
    cpu = compose["services"]["trainer-cpu"]
    assert not _gpu_reserved(cpu) and "TRAIN_MODELS" not in cpu["environment"]
    calls = _run_script(cpu["command"][0], tmp_path, **{k: str(v) for k, v in cpu["environment"].items()})
    assert calls[2:] == ["train /data/train.tsv --workdir /data/work --device cpu",
                         "export --workdir /data/work --repository /models",
                         "check --repository /models --target cpu"]


def test_cpu_profile_serves_the_embedded_configuration(compose):
    cpu = compose["services"]["triton-cpu"]
    assert cpu["build"]["dockerfile"] == "docker/cpu.Dockerfile" and not _gpu_reserved(cpu)
    assert cpu["command"][:3] == ["serve", "--repository", "/models"] and "--model-config-name" not in cpu["command"]
    assert "triton" in cpu["networks"]["default"]["aliases"]  # locust and clients use one host name
    assert "--latency-summaries" in cpu["command"]  # the dashboard's latency panels read them
    # bound to 0.0.0.0, `ensemble serve` starts only with an admin key: the service passes the host's on
    if "--host" in cpu["command"] and cpu["command"][cpu["command"].index("--host") + 1] != "127.0.0.1":
        assert cpu["environment"]["ENSEMBLE_ADMIN_KEY"] == "${ENSEMBLE_ADMIN_KEY:-}"


def test_locust_and_baseline(compose):
    services = compose["services"]
    master, worker = services["locust-master"], services["locust-worker"]
    for service in (master, worker):
        assert service["entrypoint"] == ["locust"] and "loadtest/locustfile.py" in service["command"]
    assert "--master" in master["command"] and master["command"][master["command"].index("--host") + 1] == \
        "http://triton:8000"
    assert worker["command"][worker["command"].index("--master-host") + 1] == "locust-master"
    assert set(master["depends_on"]) == {"triton", "triton-cpu"}
    assert all(d["required"] is False for d in master["depends_on"].values())
    assert services["naive"]["command"][:3] == ["baseline-serve", "--kind", "naive"]


_instructions = dockerfile_instructions


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_parses_and_passes_hadolint(path):
    assert _instructions(path)
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    done = subprocess.run([hadolint, "--no-color", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_triton_image_is_the_pinned_release():
    commands = _instructions(ROOT / "docker" / "triton.Dockerfile")
    args = dict(c.value[0].split("=", 1) for c in commands if c.cmd == "ARG" and "=" in c.value[0])
    image = next(c.value[0] for c in commands if c.cmd == "FROM")
    assert re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image) == triton_releases.PINNED.image


def _ignored(relative: str) -> bool:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    return any(fnmatch.fnmatch(relative, p) or relative.split("/")[0] == p for p in patterns)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_copy_sources_are_in_the_build_context(path, compose):
    contexts = {s["build"]["dockerfile"]: s["build"]["context"] for s in compose["services"].values() if "build" in s}
    context = (ROOT / contexts[path.relative_to(ROOT).as_posix()]).resolve()
    for command in _instructions(path):
        if command.cmd in ("COPY", "ADD") and not any(f.startswith("--from") for f in command.flags):
            for source in command.value[:-1]:
                assert (context / source).exists(), f"{path.name}: COPY {source} not in the build context"
                assert not _ignored(source), f"{path.name}: COPY {source} is excluded by .dockerignore"


def test_triton_image_installs_into_the_stub_python():
    text = (ROOT / "docker" / "triton.Dockerfile").read_text()
    runs = " ".join(c.original for c in _instructions(ROOT / "docker" / "triton.Dockerfile") if c.cmd == "RUN")
    assert "python3 -m pip install" in runs and "venv" not in runs  # the system python3 the stub embeds
    pinned = re.search(r"grep -E '\^\(([\w|]+)\)==' requirements.txt", text).group(1).split("|")
    requirements = (ROOT / "requirements.txt").read_text()
    assert all(re.search(rf"^{name}==", requirements, re.M) for name in pinned), pinned
    assert "import ensemble.scoring.pipeline" in runs  # what model.py imports, tried at build time


def test_serving_steps_need_only_numpy_and_pyarrow(trained):
    """What the triton image installs for features and blend is enough (GPU step set included)."""
    code = (
        "import sys; from ensemble.scoring.pipeline import load_step, latest_version; from pathlib import Path;"
        f"repo = Path({str(trained.repository)!r});"
        "load_step('features', latest_version(repo / 'features'), layout='gpu');"
        "load_step('blend', latest_version(repo / 'blend'));"
        "print(sorted(m for m in ('torch', 'tensorflow', 'xgboost', 'pandas', 'nvtabular', 'treelite')"
        " if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def _swapped(dockerfile: str) -> str:
    """requirements.txt after the Dockerfile's `sed -E 's/A/B/'` swap."""
    pattern = re.search(r"sed -E 's/(.+?)/(.+?)/'", (ROOT / "docker" / dockerfile).read_text())
    requirements = (ROOT / "requirements.txt").read_text()
    return re.sub(pattern.group(1), pattern.group(2).replace("\\1", r"\1"), requirements, flags=re.M)


def _pin(name: str) -> str:
    return re.search(rf"^{re.escape(name)}==(\S+)", (ROOT / "requirements.txt").read_text(), re.M).group(1)


def _installs_cpu_torch_first(dockerfile: str) -> bool:
    runs = [c.original for c in _instructions(ROOT / "docker" / dockerfile) if c.cmd == "RUN"]
    setup = next(r for r in runs if "requirements" in r and "torch" in r)
    torch_at = setup.index('"$(grep -E \'^torch==\' requirements.txt)+cpu"')
    return '--index-url "${TORCH_CPU_INDEX}"' in setup[:torch_at] and \
        torch_at < min(i for i in (setup.find("make setup"), setup.find("-r /tmp/")) if i >= 0)


def test_torch_trainer_image_has_cuda_torch_and_xgboost_and_no_cuda_tensorflow():
    swapped = _swapped("trainer.Dockerfile")
    assert re.search(rf"^xgboost=={re.escape(_pin('xgboost-cpu'))}$", swapped, re.M)
    assert re.search(rf"^torch=={re.escape(_pin('torch'))}$", swapped, re.M)  # the index's CUDA build
    assert re.search(r"^tensorflow-cpu==", swapped, re.M) and "and-cuda" not in swapped
    assert "check_install.py --torch cuda" in (ROOT / "docker" / "trainer.Dockerfile").read_text()


def test_tensorflow_trainer_image_has_cuda_tensorflow_and_cpu_torch():
    swapped = _swapped("trainer-tf.Dockerfile")
    assert re.search(rf"^tensorflow\[and-cuda\]=={re.escape(_pin('tensorflow-cpu'))}$", swapped, re.M)
    assert re.search(r"^xgboost-cpu==", swapped, re.M)
    assert _installs_cpu_torch_first("trainer-tf.Dockerfile")
    text = (ROOT / "docker" / "trainer-tf.Dockerfile").read_text()
    assert "check_install.py --torch cpu" in text and "ensure_treelite(PINNED.treelite)" in text


def test_cpu_image_installs_the_cpu_torch_and_no_cuda_wheels():
    assert _installs_cpu_torch_first("cpu.Dockerfile")
    assert "check_install.py --torch cpu --no-cuda-wheels" in (ROOT / "docker" / "cpu.Dockerfile").read_text()


def test_install_check_finds_clashing_files_and_cuda_wheels(tmp_path):
    """docker/check_install.py on real distribution metadata: two wheels writing one library."""
    import importlib.util
    from importlib import metadata

    spec = importlib.util.spec_from_file_location("check_install", ROOT / "docker" / "check_install.py")
    check_install = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check_install)
    dists = []
    for name, files in (("nvidia-cudnn-cu12", ["nvidia/cudnn/lib/libcudnn.so.9", "nvidia/cudnn/__init__.py"]),
                        ("nvidia-cudnn-cu13", ["nvidia/cudnn/lib/libcudnn.so.9"]),
                        ("nvidia-pytriton", ["pytriton/__init__.py"])):
        info = tmp_path / f"{name.replace('-', '_')}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        (info / "RECORD").write_text("".join(f"{f},,\n" for f in [*files, f"{info.name}/METADATA"]))
        dists.append(metadata.PathDistribution(info))
    assert check_install.clashes(dists) == {"nvidia/cudnn/lib/libcudnn.so.9": ["nvidia-cudnn-cu12", "nvidia-cudnn-cu13"]}
    assert check_install.cuda_wheels(dists) == ["nvidia-cudnn-cu12", "nvidia-cudnn-cu13"]
    assert check_install.clashes() == {}  # this environment
    assert check_install.main(["--torch", "cpu", "--no-cuda-wheels"]) == 0  # CPU torch, no CUDA wheels here
    assert check_install.main(["--torch", "cuda"]) == 1


def test_cpu_image_uses_the_project_setup():
    text = (ROOT / "docker" / "cpu.Dockerfile").read_text()
    assert "make setup" in text and re.search(r"^setup:", (ROOT / "Makefile").read_text(), re.M)
