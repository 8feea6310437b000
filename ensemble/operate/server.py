"""Start a real tritonserver on a model repository.

The binary is the one the ``nvidia-pytriton`` wheel ships (Triton 2.51 with the python
backend), or a ``tritonserver`` on PATH. The python backend stub embeds libpython and finds
packages through the first ``python3`` on PATH, so the server's PATH starts with this
interpreter's ``bin/``; PYTHONPATH adds this project so ``model.py`` can import ``ensemble``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ensemble.repository.configs import LATENCY_OBJECTIVE_PARAMETER, config_file, config_name, parse as parse_config
from ensemble import online
from ensemble.operate import allocator, lifecycle, processes, records
from ensemble.repository import declared
from ensemble.operate.allocator import Allocator
from ensemble.operate.control import RELEASE_HEADER, SHADOW_HEADER, Control, ControlError, restricted_options
from ensemble.models.registry import Layout
from ensemble import schema
from ensemble.schema import Model
from ensemble.operate.monitoring import LatencySummaries
from ensemble.operate.door import door_options
from ensemble.base.machine import port_free

LOG = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parent.parent
# What `ensemble serve` serves on CPU unless told otherwise: the whole chain inside Triton's own
# process, through the project's backend (docs/serving.md, "Layouts"); `fused` is the python-backend
# fallback.
DEFAULT_LAYOUT = Layout.NATIVE


class ServerError(RuntimeError):
    """The server failed to start or died; the message ends with its log tail."""


@dataclass(frozen=True)
class ServerOptions:
    """How to run tritonserver.

    Attributes:
        repository: the model repository folder.
        host: address HTTP, gRPC and metrics bind to (loopback unless told otherwise).
        http_port, grpc_port, metrics_port: ports (0 is not allowed; pick free ones).
        layout: which layout of the repository to serve (see :mod:`ensemble.repository.configs`); the server
            reads that layout's config files and loads ``ranker`` and what it runs, nothing else
            (explicit model control).
        log_file: where the server's output goes (a temp file if None).
        startup_timeout: seconds to wait for readiness.
        cpu_list: run under ``taskset -c <cpu_list>`` (e.g. "1") to keep a load generator off
            the server's cores.
        admin_key: when set, Triton's model-repository API (load/unload: what ``ensemble
            deploy`` and the supervisor use) answers only requests carrying it in the
            ``ensemble-admin-key`` header (:mod:`ensemble.operate.control`). Required to bind a
            non-loopback address.
        latency_summaries: Prometheus latency summaries on the metrics port (off by default; see
            :mod:`ensemble.operate.monitoring`).
        latency_objective_ms: the fused ranker's latency objective (:mod:`ensemble.serving.admission`):
            the ranker is loaded with it in its config. None: the repository config's own
            (``configs.DEFAULT_OBJECTIVE_MS`` as exported).
        allocator: the memory allocator tritonserver runs with (:mod:`ensemble.operate.allocator`).
        require_engine: a DLRM step whose release records an engine that cannot run here fails to load
            (so the server does not start) instead of scoring with another (:mod:`ensemble.models.engines`).
    """

    repository: Path
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    layout: Layout = DEFAULT_LAYOUT
    log_file: Path | None = None
    startup_timeout: float = 300.0
    cpu_list: str | None = None
    admin_key: str | None = None
    latency_summaries: LatencySummaries = LatencySummaries()
    latency_objective_ms: float | None = None
    require_engine: bool = False
    allocator: Allocator = Allocator.AUTO
    store: online.StoreSettings | None = None  # the online store of ranking requests by ids
    tables: dict[str, str] = field(default_factory=dict)  # a row store's settings (ensemble.tables.serving)

    @property
    def loopback(self) -> bool:
        import ipaddress

        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return self.host == "localhost"


def _pytriton_dir() -> Path | None:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "tritonserver"


def _check_native_backend(repository: Path) -> None:
    """The native layout serves a release only when its folder holds the backend library (``ensemble
    export`` copies it there when the project's install built it)."""
    from ensemble.native import backend

    ranker = repository / Model.RANKER.value
    releases = [p for p in ranker.iterdir() if p.is_dir() and p.name.isdigit()] if ranker.is_dir() else []
    if releases and not any((p / backend.FILE_NAME).is_file() for p in releases):
        try:
            backend.library()
            why = "export the repository again (ensemble export) to add it"
        except backend.NotBuilt as exc:
            why = str(exc)
        raise ServerError(f"the native layout needs {backend.FILE_NAME} in a release folder of {ranker}: {why}")
    installed = backend.installed_api()
    for release in sorted(releases, key=lambda p: int(p.name)):
        library = release / backend.FILE_NAME
        if not library.is_file() or installed is None:
            continue
        try:
            said = backend.capabilities(library)
        except OSError as exc:
            raise ServerError(f"{library} cannot be loaded: {exc}") from exc
        if said.api != installed:  # it would serve on the slower path, its row store metrics off: said, not hidden
            LOG.warning("%s calls the C entry points of version %s, the installed modules offer %s: its chain "
                        "runs the Python path and its row store has no metrics; export the release again",
                        library, said.api or "(older than the capability symbol)", installed)


def find_tritonserver() -> Path:
    """The wheel's binary, else ``tritonserver`` on PATH."""
    bundled = _pytriton_dir()
    if bundled is not None and (bundled / "bin" / "tritonserver").is_file():
        return bundled / "bin" / "tritonserver"
    on_path = shutil.which("tritonserver")
    if on_path:
        return Path(on_path)
    raise ServerError("no tritonserver found: install nvidia-pytriton (make demo does) or put one on PATH")


def _backend_directory(binary: Path, into: Path) -> Path:
    """Backends next to the binary, with the python stub built for this Python version."""
    dist = binary.parent.parent
    backends = into / "backends"
    shutil.copytree(dist / "backends", backends)
    stub = dist / "python_backend_stubs" / f"{sys.version_info.major}.{sys.version_info.minor}" / \
        "triton_python_backend_stub"
    if stub.is_file():
        shutil.copy2(stub, backends / "python" / "triton_python_backend_stub")
    return backends


class TritonServer:
    """A tritonserver process: ``start()`` waits until ready, ``stop()`` terminates -> waits -> kills."""

    def __init__(self, options: ServerOptions):
        self.options = options
        self.process: subprocess.Popen | None = None
        self._scratch: Path | None = None
        self._started_at: float | None = None  # wall clock, for the shared memory its processes leave
        self.log_file = options.log_file

    @property
    def http_url(self) -> str:
        return f"{self.options.host}:{self.options.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.options.host}:{self.options.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.options.host}:{self.options.metrics_port}/metrics"

    def command(self, binary: Path, backends: Path) -> list[str]:
        o = self.options
        cmd = [str(binary), f"--model-repository={Path(o.repository).resolve()}",
               f"--backend-directory={backends}",
               f"--http-address={o.host}", f"--http-port={o.http_port}",
               f"--grpc-address={o.host}", f"--grpc-port={o.grpc_port}",
               f"--metrics-address={o.host}", f"--metrics-port={o.metrics_port}",
               "--allow-gpu-metrics=false", "--exit-on-error=true", "--log-verbose=0",
               *o.latency_summaries.server_args()]
        cmd.append(f"--model-config-name={config_name(Layout(o.layout))}")
        cmd.append("--model-control-mode=explicit")
        if not self._ranker_override():  # else start() loads it with the objective or release in its config
            cmd.append(f"--load-model={Model.RANKER.value}")
        if (Path(o.repository) / schema.RANK_MODEL / config_file(Layout(o.layout))).is_file():
            cmd.append(f"--load-model={schema.RANK_MODEL}")  # ranking requests (ensemble/serving/rank_model.py)
        cmd += door_options(binary, self.environment(binary))
        # the release a fleet's gateway routes a request to, and the candidates that shadow it, reach the
        # models as request parameters
        forwarded = f"^({RELEASE_HEADER}|{SHADOW_HEADER})$"
        cmd += [f"--http-header-forward-pattern={forwarded}", f"--grpc-header-forward-pattern={forwarded}"]
        if o.admin_key:
            cmd += restricted_options(o.admin_key)
        if o.cpu_list:
            cmd = ["taskset", "-c", o.cpu_list, *cmd]
        return cmd

    def environment(self, binary: Path) -> dict[str, str]:
        env = dict(os.environ)
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH")) if p)
        libs = binary.parent.parent.parent.parent / "nvidia_pytriton.libs"
        if libs.is_dir():
            env["LD_LIBRARY_PATH"] = os.pathsep.join(
                p for p in (env.get("LD_LIBRARY_PATH"), str(libs)) if p)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        # No OpenBLAS worker threads in Triton's process: the native layout's embedded interpreter loads
        # numpy/scipy's OpenBLAS there, whose fork handler joins its worker threads by id; after one
        # fork (the python backend forks to start every stub) those ids can belong to new threads, and
        # the next fork then waits on a thread that never ends (seen: `rank` stubs starting after the
        # native ranker loaded, about 1 start in 9). The models here compute on one thread anyway.
        env.setdefault("OPENBLAS_NUM_THREADS", "1")
        # oneTBB (under OpenVINO, the DLRM engine a release may record) opens its hwloc binding with
        # RTLD_DEEPBIND unless this is set: the deep-bound hwloc then frees memory the preloaded tcmalloc
        # allocated with glibc's free, and tritonserver aborts ("free(): invalid pointer") at the first
        # model OpenVINO compiles. The variable changes only that binding flag.
        env.setdefault("TBB_ENABLE_SANITIZERS", "1")
        if self.options.require_engine:  # a DLRM step whose recorded engine cannot run here does not load
            from ensemble.models.engines import REQUIRE_ENV

            env[REQUIRE_ENV] = "1"
        if self.options.store is not None:  # the rank model reads it at load (ensemble/online/)
            env.update(self.options.store.environment())
        env.update(self.options.tables)  # a row store DLRM reads them at load (ensemble/tables/serving.py)
        return allocator.preloaded(env, self.options.allocator)

    def start(self) -> "TritonServer":
        layout = Layout(self.options.layout)
        if self.options.latency_objective_ms is not None and layout not in (Layout.FUSED, Layout.NATIVE):
            raise ServerError("a latency objective applies to the fused and native layouts' ranker (the gpu "
                              "layout's steps do not refuse requests)")
        if layout is Layout.NATIVE:
            _check_native_backend(Path(self.options.repository))
        try:  # a declared release that is gone: refuse, rather than serve a release nobody deployed
            self.declared_release()
        except declared.DeclaredMissing as exc:
            raise ServerError(f"not started: {exc}") from None
        try:
            allocator.library(self.options.allocator)
        except FileNotFoundError as exc:
            raise ServerError(str(exc)) from None
        if self.options.latency_objective_ms is not None and not self.options.latency_objective_ms > 0:
            raise ServerError(f"the latency objective must be > 0 ms, got {self.options.latency_objective_ms:g}")
        if not self.options.loopback and not self.options.admin_key:
            raise ServerError(f"binding {self.options.host} would open Triton's model control (load/unload) to "
                              "anyone who reaches the port: set ENSEMBLE_ADMIN_KEY (the clients' inference API "
                              "stays open; deploy and the supervisor send the key)")
        busy = [port for port in (self.options.http_port, self.options.grpc_port, self.options.metrics_port)
                if not port_free(self.options.host, port)]
        if busy:  # else the readiness probe could reach whatever holds the port and report ready
            raise ServerError(f"port(s) {', '.join(map(str, busy))} on {self.options.host} already in use")
        binary = find_tritonserver()
        self._scratch = Path(tempfile.mkdtemp(prefix="ensemble-triton-"))
        backends = _backend_directory(binary, self._scratch)
        if self.log_file is None:
            self.log_file = self._scratch / "tritonserver.log"
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        self._started_at = time.time() - 0.1  # file times tick coarser than time.time()
        with open(self.log_file, "ab") as log:
            self.process = subprocess.Popen(self.command(binary, backends), stdout=log,
                                            stderr=subprocess.STDOUT, env=self.environment(binary),
                                            start_new_session=True)
        records.record_server(self.process.pid, self.options.repository, self.http_url)
        deadline = time.monotonic() + self.options.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self._cleanup()
                raise ServerError(f"tritonserver exited with code {self.process.returncode}\n{self.log_tail()}")
            if self.ready():
                if self._ranker_override():
                    self._load_ranker_with_overrides()
                return self
            time.sleep(0.25)
        tail = self.log_tail()
        self.stop()
        raise ServerError(f"tritonserver not ready after {self.options.startup_timeout:.0f}s\n{tail}")

    def declared_release(self) -> int | None:
        """The release the last deploy or rollback declared for this repository
        (:mod:`ensemble.repository.declared`), which this server loads instead of the newest; None:
        the newest. Only the fused and native layouts serve a release as one model version.

        Raises:
            declared.DeclaredMissing: the declared release is not in the repository.
        """
        if Layout(self.options.layout) not in (Layout.FUSED, Layout.NATIVE):
            return None
        return declared.read(self.options.repository)

    def declared_versions(self) -> list[int] | None:
        """The ranker versions this server loads: the declared release, and during a release across a
        fleet the other one being switched to or from (None: the newest)."""
        return declared.versions(self.options.repository) if self.declared_release() is not None else None

    def _ranker_override(self) -> bool:
        return self.options.latency_objective_ms is not None or self.declared_release() is not None

    def _load_ranker_with_overrides(self) -> None:
        """Load the ranker from the repository's config file of this layout, with the server's
        latency objective in place of the file's and the declared release as its only version (a
        config override: Triton then reports both)."""
        from google.protobuf import json_format

        o = self.options
        path = Path(o.repository) / Model.RANKER.value / config_file(Layout(o.layout))
        config = json_format.MessageToDict(parse_config(path.read_text()), preserving_proto_field_name=True)
        if o.latency_objective_ms is not None:
            config.setdefault("parameters", {})[LATENCY_OBJECTIVE_PARAMETER] = {
                "string_value": f"{o.latency_objective_ms:g}"}
        versions = self.declared_versions()
        if versions:
            config["version_policy"] = {"specific": {"versions": versions}}
        try:
            Control.of(self.http_url, key=o.admin_key or "", grpc=self.grpc_url).load(config)
        except ControlError as exc:
            tail = self.log_tail()
            self.stop()
            raise ServerError(f"the ranker did not load: {exc}\n{tail}") from exc

    def ready(self) -> bool:
        return lifecycle.http_ready(f"http://{self.http_url}")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        """The server's error lines (Triton prefixes them with ``E``), then the last lines."""
        if self.log_file is None or not Path(self.log_file).is_file():
            return "(no log)"
        text = Path(self.log_file).read_text(errors="replace").splitlines()
        errors = [line[:2000] for line in text if line[:1] == "E" and line[1:5].isdigit()]
        # the CUDA driver probe's complaints (no GPU here) come first in the log; the cause after
        errors.sort(key=lambda line: "cuda" in line.lower())
        return "\n".join(["--- errors ---", *errors[-10:], "--- last lines ---", *text[-lines:]])

    def stop(self, timeout: float = 20.0) -> int | None:
        ours = processes.shm_regions(processes.group(self.process.pid)) if self.process is not None else set()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self._kill_group()
        self._remove_orphan_regions(ours)
        # a clean shutdown leaves nothing in the temp folder; after a failure the log stays there
        self._cleanup(keep_log=self.process is None or self.process.returncode != 0)
        return None if self.process is None else self.process.returncode

    def kill(self) -> None:
        """SIGKILL the server and every process left in its process group (the backend stubs
        outlive a server that died: they would stay behind as orphans), then the python backend's
        shared memory they leave behind."""
        ours = processes.shm_regions(processes.group(self.process.pid)) if self.process is not None else set()
        self._kill_group()
        self._remove_orphan_regions(ours)
        self._cleanup()

    def _remove_orphan_regions(self, ours: set[str] = frozenset()) -> None:
        """Delete the python backend's shared-memory files created since this server started that
        no process maps now (Triton deletes them only on a clean exit), and ``ours`` (the files its
        processes mapped before they were killed) as soon as no process maps them: a killed stub
        can take longer to exit than the group's wait on a loaded machine."""
        if self._started_at is not None:
            processes.remove_orphan_regions(since=self._started_at)
        processes.remove_when_unmapped(ours)

    def _kill_group(self) -> None:
        if self.process is None:
            return
        try:  # the group was created for this server (start_new_session), so it holds only its processes
            os.killpg(self.process.pid, 9)
        except ProcessLookupError:
            pass
        self.process.wait()
        deadline = time.monotonic() + 2.0  # its killed stubs let go of their memory (and shared memory)
        while processes.group(self.process.pid) and time.monotonic() < deadline:
            time.sleep(0.01)

    def _cleanup(self, keep_log: bool = True) -> None:
        if self.process is not None:
            records.forget_server(self.process.pid)
        if self._scratch is None or not self._scratch.is_dir():
            return
        if not keep_log:
            shutil.rmtree(self._scratch, ignore_errors=True)
            return
        for item in self._scratch.iterdir():  # the backends copy; the log (when it lives here) stays
            if item.is_dir():
                shutil.rmtree(item, ignore_errors=True)
        processes.remove_if_empty(self._scratch)

    def resident_memory_bytes(self) -> int:
        """Resident memory of the server and every process it started (the backend stubs)."""
        if not self.alive():
            return 0
        return sum(processes.rss(pid) for pid in processes.tree(self.process.pid))

    def stub_pids(self) -> dict[str, int]:
        """Model name -> pid of the python-backend stub serving it."""
        return processes.stub_pids(self.process.pid) if self.alive() else {}

    def backend_processes(self) -> dict[str, dict]:
        """Per python-backend stub process: the model it serves, its resident memory, and which
        heavy frameworks it has loaded."""
        if not self.alive():
            return {}
        return {model: {"pid": pid, "rss_mib": processes.rss(pid) / 2**20,
                        "frameworks": processes.frameworks_loaded(pid)}
                for model, pid in processes.stub_pids(self.process.pid).items()}

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) used so far by the server process and by each model's stub,
        keyed "tritonserver" and the model name."""
        if not self.alive():
            return {}
        pids = {"tritonserver": self.process.pid, **processes.stub_pids(self.process.pid)}
        return {name: processes.cpu_seconds(pid) for name, pid in pids.items()}

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
