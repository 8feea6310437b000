"""The C code that reads client bytes, under AddressSanitizer and UndefinedBehaviorSanitizer.

1. Builds every extension module with ``-fsanitize=address,undefined`` (gcc, setup.py's own flags
   otherwise) into ``build/sanitize/lib``, next to a copy of the package's Python files; the modules in
   the source tree are left as they are.
2. Runs the unit tests of the C paths on those modules (``tests/fuzz/sanitized_modules.py`` puts them
   first), with gcc's libasan preloaded into Python.
3. Serves the native layout from the real tritonserver with that build's ``libtriton_native.so`` (its
   embedded interpreter importing the sanitized modules), libasan preloaded and leak detection on: first
   a backend that leaks on purpose must be caught, then the integration tests that exercise the backend
   and its allocations failing on demand (``tests/fuzz/backend_faults.py``) run against it; every
   server's sanitizer log (``build/sanitize/served``) must be clean at its exit.
4. Builds each fuzz target of ``tests/fuzz/targets`` with clang's libFuzzer (plus both sanitizers) and
   runs it for ``--seconds`` from its committed seeds in ``tests/fuzz/corpus/<target>``; what it finds
   on the way is kept in ``build/sanitize/corpus`` and a crashing input in ``build/sanitize/crashes``.

Any sanitizer report, fuzz check or crash fails the run; it ends with one summary table.

    .venv/bin/python -m tests.fuzz.sanitize                   # what `make test` runs (25 s a target)
    .venv/bin/python -m tests.fuzz.sanitize --seconds 600 --fuzz-only   # a longer run
    .venv/bin/python -m tests.fuzz.sanitize --served-only     # the build and the backend in tritonserver
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build" / "sanitize"
LIB = BUILD / "lib"
TARGETS = ROOT / "tests" / "fuzz" / "targets"
CORPUS = ROOT / "tests" / "fuzz" / "corpus"
MODULES = ("ensemble.native._request", "ensemble.native._chain", "ensemble.native._admission",
           "ensemble.native._trees", "ensemble.native._dlrm", "ensemble.native._openvino", "ensemble.native._tables")
# The unit tests that run the C modules (the native backend's checks are fuzzed, not unit-tested here).
UNIT_TESTS = ("tests/unit/test_native.py", "tests/unit/test_chain.py", "tests/unit/test_admission.py",
              "tests/unit/test_embedded.py", "tests/unit/test_c_hostile.py", "tests/unit/test_tables.py",
              "tests/unit/test_models.py::test_the_c_forward_pass_reads_both_exported_dlrms_and_gives_their_scores",
              "tests/unit/test_models.py::test_the_c_interaction_gives_pairs_in_any_order_the_same_sums",
              "tests/unit/test_models.py::test_the_avx512_build_gives_the_avx2_builds_floats",
              "tests/unit/test_models.py::test_tree_arrays_equal_xgboost_with_missing_values_on_every_batch_size",
              "tests/unit/test_engines.py::test_the_openvino_engine_scores_as_the_framework_and_refuses_ids_outside_the_tables")
FUZZ_TARGETS = ("split_wire", "lookup_wire", "dense_prepare", "tsv_to_wire", "plain_checks", "release")
# The integration tests that exercise the native backend in tritonserver (their native layout's cases:
# tests/fuzz/sanitized_server.py deselects the others): hostile and malformed requests at the door and in
# the tensors, every path of a call (C, the model's execute, the bulk lane), ranking requests, the metrics,
# a row store's release (its cold reads, a slow disk and a bad block answered per request, a load that
# fails); then its allocations failing (not part of the normal run). Left out: a python-backend layout's
# test, and a row store's redis cluster (redis-server would run with the preload too).
SERVED_TESTS = ("tests/integration/test_hostile_input.py", "tests/integration/test_bad_input.py",
                "tests/integration/test_ranker.py", "tests/integration/test_rank_bounds.py",
                "tests/integration/test_metrics.py", "tests/integration/test_tables.py",
                "tests/fuzz/backend_faults.py",
                *(f"--deselect=tests/integration/{test}" for test in (
                    "test_rank_bounds.py::test_the_python_rank_model_runs_below_the_rankers_priority",
                    "test_tables.py::test_the_fused_layout_refuses_a_row_store_release",
                    "test_tables.py::test_a_fleets_cold_tier_in_a_redis_cluster_gives_the_disks_answers")))
SERVED = BUILD / "served"  # the servers' sanitizer logs (sanitizer.<program>.<pid>)
LEAK_CHECK = BUILD / "leak_check"
SUPPRESSIONS = ROOT / "tests" / "fuzz" / "lsan.supp"
SANITIZE = "-fsanitize=address,undefined"
REPORT = re.compile(r"ERROR: AddressSanitizer|runtime error:|ERROR: libFuzzer|fuzz check failed|SUMMARY: ")
SANITIZER_ENV = {
    "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:halt_on_error=1",
    "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
    # oneTBB (under OpenVINO, which the tests' exports measure) opens its hwloc binding with RTLD_DEEPBIND
    # unless this is set, and ASan aborts a process that does
    "TBB_ENABLE_SANITIZERS": "1",
}
LEAK_REPORT = re.compile(r"ERROR: LeakSanitizer")
LEAK_CHECKED = "Suppressions used:"  # LSan's table of what it suppressed at exit: the check ran


@dataclass
class Step:
    name: str
    ok: bool
    detail: str
    seconds: float


def _run(cmd: list[str], env: dict[str, str] | None = None, log: Path | None = None) -> tuple[int, str]:
    """Runs cmd, echoing nothing; returns its exit code and its combined output (also written to log)."""
    done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace")
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(done.stdout)
    return done.returncode, done.stdout


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def build_modules() -> Step:
    """The extension modules with both sanitizers into build/sanitize/lib, beside the package's .py files."""
    start = time.monotonic()
    shutil.rmtree(LIB, ignore_errors=True)
    shutil.copytree(ROOT / "ensemble", LIB / "ensemble", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    # ENSEMBLE_ALLOC_FAULTS: the native backend can fail its own allocations on demand (backend_internal.h)
    env = dict(os.environ, CC="gcc", LDFLAGS=SANITIZE,
               CFLAGS=f"{SANITIZE} -fno-sanitize-recover=all -fno-omit-frame-pointer -g -DENSEMBLE_ALLOC_FAULTS")
    code, output = _run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(LIB),
                         "--build-temp", str(BUILD / "tmp"), "--force"], env=env, log=BUILD / "build.log")
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    missing = [m for m in MODULES if not (LIB / (m.replace(".", "/") + suffix)).exists()]
    ok = code == 0 and not missing
    detail = f"{len(MODULES) - len(missing)}/{len(MODULES)} modules" + (f"; missing {', '.join(missing)}" if missing else "")
    if not ok:
        print(_tail(output), file=sys.stderr)
    return Step("sanitized build (gcc)", ok, detail, time.monotonic() - start)


def unit_tests(extra: list[str]) -> Step:
    """The C paths' unit tests on the sanitized modules, libasan preloaded into the interpreter."""
    start = time.monotonic()
    # libstdc++ too: ASan finds the C++ runtime's functions it intercepts (__cxa_throw) only when that is
    # loaded with it, and the frameworks the tests import throw C++ exceptions.
    preload = " ".join(_gcc_file(lib) for lib in ("libasan.so", "libstdc++.so"))
    env = dict(os.environ, LD_PRELOAD=preload, ENSEMBLE_SANITIZED_LIB=str(LIB), **SANITIZER_ENV)
    code, output = _run([sys.executable, "-m", "pytest", "-p", "tests.fuzz.sanitized_modules", "-q", "-p", "no:randomly",
                         *UNIT_TESTS, *extra], env=env, log=BUILD / "unit_tests.log")
    reports = [line for line in output.splitlines() if REPORT.search(line)]
    summary = next((line for line in reversed(output.splitlines()) if re.search(r"\d+ (passed|failed)", line)), "")
    ok = code == 0 and not reports
    if not ok:
        print(_tail(output, 80), file=sys.stderr)
    detail = summary.strip("= ") + (f"; {len(reports)} sanitizer report lines" if reports else "")
    return Step("unit tests on sanitized modules", ok, detail, time.monotonic() - start)


def _gcc_file(name: str) -> str:
    """A file of gcc's own (its libasan, its libstdc++), by the path gcc links."""
    return subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()


def server_environment(log_dir: Path) -> dict[str, str]:
    """What a sanitized tritonserver runs with (besides LD_PRELOAD): leaks checked at its exit, with
    Triton's and CPython's own suppressed (tests/fuzz/lsan.supp); ASan's and LSan's reports in
    ``log_dir/sanitizer.<program>.<pid>`` (UBSan's on its stderr, the server's log: its first ends the
    server, so the tests fail too); Python's objects from malloc, so ASan sees their bounds."""
    return {
        "ASAN_OPTIONS": f"detect_leaks=1:halt_on_error=1:log_path={log_dir / 'sanitizer'}:log_exe_name=1",
        "LSAN_OPTIONS": f"suppressions={SUPPRESSIONS}:print_suppressions=1",
        "UBSAN_OPTIONS": SANITIZER_ENV["UBSAN_OPTIONS"],
        "PYTHONMALLOC": "malloc",
        "TBB_ENABLE_SANITIZERS": "1",
    }


def server_preload() -> tuple[str | None, str]:
    """LD_PRELOAD for a sanitized tritonserver (None when it cannot be built; then the compiler's output):
    gcc's libasan first, as ASan requires; tests/fuzz/asan_init_first.c, which starts ASan before the
    locale lock can be taken (see there); libstdc++, so ASan intercepts C++ exceptions."""
    shim = BUILD / "asan_init_first.so"
    shim.parent.mkdir(parents=True, exist_ok=True)
    asan = _gcc_file("libasan.so")
    code, output = _run(["gcc", "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(shim),
                         str(ROOT / "tests" / "fuzz" / "asan_init_first.c"), asan, "-ldl"])
    return (f"{asan} {shim} {_gcc_file('libstdc++.so')}" if code == 0 else None), output


def _sanitizer_logs(folder: Path, program: str = "") -> dict[Path, str]:
    return {path: path.read_text(errors="replace") for path in sorted(folder.glob(f"sanitizer.{program}*"))}


def leak_check(preload: str) -> str | None:
    """The leak check's own test: tritonserver, run as the native backend's servers are, loads
    tests/fuzz/leaky_backend.c (a backend whose model load leaks a block) and is stopped; its leak must be
    reported. None when it is; else what went wrong."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    from ensemble.operate.server import find_tritonserver
    from ensemble.base.machine import free_ports

    shutil.rmtree(LEAK_CHECK, ignore_errors=True)
    model = LEAK_CHECK / "repository" / "leaky"
    (model / "1").mkdir(parents=True)
    code, output = _run(["gcc", "-shared", "-fPIC", "-g", "-O0", f"-I{ROOT / 'ensemble' / 'native'}", "-o",
                         str(model / "1" / "libtriton_leaky.so"), str(ROOT / "tests" / "fuzz" / "leaky_backend.c")])
    if code != 0:
        return f"the leaking backend did not build: {_tail(output, 5)}"
    tensor = {"data_type": mc.TYPE_FP32, "dims": [1]}
    config = mc.ModelConfig(name="leaky", backend="leaky", max_batch_size=0,
                            input=[mc.ModelInput(name="x", **tensor)], output=[mc.ModelOutput(name="y", **tensor)])
    (model / "config.pbtxt").write_text(text_format.MessageToString(config))
    http, grpc, metrics = free_ports(3)
    env = dict(os.environ, LD_PRELOAD=preload, **server_environment(LEAK_CHECK))
    with open(LEAK_CHECK / "tritonserver.log", "wb") as log:
        server = subprocess.Popen([str(find_tritonserver()), f"--model-repository={model.parent}",
                                   f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}",
                                   "--allow-gpu-metrics=false", "--exit-on-error=true"],
                                  stdout=log, stderr=subprocess.STDOUT, env=env)
    ready, deadline = False, time.monotonic() + 120
    while not ready and server.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
        try:
            ready = urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/models/leaky/ready", timeout=2).status == 200
        except OSError:
            pass
    server.terminate()
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        server.kill()
        return "tritonserver did not exit within 60 s of SIGTERM"
    reports = "".join(_sanitizer_logs(LEAK_CHECK, "tritonserver").values())
    if not ready:
        return f"the leaking backend's model did not load (see {LEAK_CHECK / 'tritonserver.log'})"
    if not LEAK_REPORT.search(reports) or "leaky_backend.c" not in reports:
        return f"no report of the leaking backend's block in {LEAK_CHECK}"
    return None


def served_backend(tests: tuple[str, ...] = SERVED_TESTS) -> Step:
    """The native backend in tritonserver: the leak check's own test, then ``tests`` (pytest's arguments)
    against servers that run the sanitized build (tests/fuzz/sanitized_server.py); the detail counts the
    servers whose leak check ran at exit (each writes LSan's table of suppressions) and their reports."""
    name = "native backend in tritonserver"
    start = time.monotonic()
    preload, output = server_preload()
    if preload is None:
        print(_tail(output), file=sys.stderr)
        return Step(name, False, "tests/fuzz/asan_init_first.c did not build", time.monotonic() - start)
    missed = leak_check(preload)
    if missed is not None:
        return Step(name, False, f"the leak check's own test failed: {missed}", time.monotonic() - start)
    shutil.rmtree(SERVED, ignore_errors=True)
    SERVED.mkdir(parents=True)
    if not (LIB / "docker").exists():  # the dashboard the metrics tests read, found beside the package
        (LIB / "docker").symlink_to(ROOT / "docker")
    env = dict(os.environ, LD_PRELOAD=preload, ENSEMBLE_SANITIZED_LIB=str(LIB), **SANITIZER_ENV)
    code, output = _run([sys.executable, "-m", "pytest", "-p", "tests.fuzz.sanitized_modules", "-p",
                         "tests.fuzz.sanitized_server", "-q", "-p", "no:randomly", f"--basetemp={BUILD / 'served_tmp'}",
                         *tests], env=env, log=BUILD / "served.log")
    # tritonserver's logs only: what else the tests start inherits the preload (ctypes.util runs gcc and ld
    # to find a library), and its own exit is not the backend's
    logs = _sanitizer_logs(SERVED, "tritonserver")
    reports = [path.name for path, text in logs.items() if REPORT.search(text) or LEAK_REPORT.search(text)]
    # every server the tests started must have ended through exit, where LSan looks (a killed one did not)
    started = set((SERVED / "started").read_text().split()) if (SERVED / "started").is_file() else set()
    checked = {path.name.rsplit(".", 1)[1] for path, text in logs.items() if LEAK_CHECKED in text}
    summary = next((line for line in reversed(output.splitlines()) if re.search(r"\d+ (passed|failed)", line)), "")
    ok = code == 0 and not reports and bool(started) and started <= checked
    if not ok:
        print(_tail(output, 80), file=sys.stderr)
    detail = (f"{summary.strip('= ')}; {len(started & checked)}/{len(started)} servers leak-checked at exit, "
              f"{len(reports)} reports")
    if reports:
        detail += f" ({', '.join(reports)} in {SERVED.relative_to(ROOT)})"
    if started - checked:
        detail += f"; no leak check in tritonserver {', '.join(sorted(started - checked))} (killed?)"
    return Step(name, ok, detail, time.monotonic() - start)


def _python_link() -> list[str]:
    config = sysconfig.get_config_vars()
    return [f"-I{sysconfig.get_paths()['include']}", f"-L{config['LIBDIR']}", f"-lpython{config['LDVERSION']}",
            f"-Wl,-rpath,{config['LIBDIR']}"]


def build_target(name: str) -> tuple[Path | None, str]:
    binary = BUILD / "fuzz" / name
    binary.parent.mkdir(parents=True, exist_ok=True)
    code, output = _run(["clang", "-g", "-O1", f"{SANITIZE},fuzzer", "-fno-sanitize-recover=all", "-Wall", "-Wextra",
                         "-Werror", "-Wno-unused-parameter", f"-I{ROOT / 'ensemble'}", str(TARGETS / f"{name}.c"),
                         "-o", str(binary), *_python_link(), "-lz"],  # _request.c hashes with zlib's crc32
                        log=BUILD / "fuzz" / f"{name}.build.log")
    return (binary if code == 0 else None), output


def fuzz(name: str, seconds: int) -> Step:
    """One target from its seeds for `seconds`; its executions, corpus and coverage in the detail."""
    start = time.monotonic()
    if shutil.which("clang") is None:
        return Step(f"fuzz {name}", False, "clang not found (apt-get install clang)", 0.0)
    binary, output = build_target(name)
    if binary is None:
        print(_tail(output), file=sys.stderr)
        return Step(f"fuzz {name}", False, "did not build", time.monotonic() - start)
    found = BUILD / "corpus" / name
    found.mkdir(parents=True, exist_ok=True)
    crashes = BUILD / "crashes"
    crashes.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, **SANITIZER_ENV)
    code, output = _run([str(binary), f"-max_total_time={seconds}", "-timeout=10", "-rss_limit_mb=2048",
                         "-print_final_stats=1", f"-artifact_prefix={crashes}/{name}-", str(found), str(CORPUS / name)],
                        env=env, log=BUILD / "fuzz" / f"{name}.log")
    runs = re.search(r"stat::number_of_executed_units:\s*(\d+)", output)
    cov = re.findall(r"cov: (\d+) ft: (\d+) corp: (\d+)", output)
    reports = [line for line in output.splitlines() if REPORT.search(line)]
    ok = code == 0 and runs is not None and not reports
    if not ok:
        print(_tail(output, 60), file=sys.stderr)
    detail = f"{int(runs.group(1)):,} runs" if runs else "no run count"
    if cov:
        detail += f", coverage {cov[-1][0]} edges, corpus {cov[-1][2]}"
    if not ok:
        detail += f"; exit {code}, see {BUILD / 'fuzz' / (name + '.log')}"
    return Step(f"fuzz {name}", ok, detail, time.monotonic() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=25, help="how long each fuzz target runs")
    parser.add_argument("--targets", nargs="*", default=list(FUZZ_TARGETS), choices=FUZZ_TARGETS)
    parser.add_argument("--fuzz-only", action="store_true", help="only the fuzz targets")
    parser.add_argument("--no-fuzz", action="store_true", help="no fuzz targets")
    parser.add_argument("--served-only", action="store_true",
                        help="only the sanitized build and the native backend in tritonserver")
    parser.add_argument("--no-served", action="store_true", help="not the native backend in tritonserver")
    parser.add_argument("--served-tests", nargs="+", metavar="PYTEST_ARG", default=list(SERVED_TESTS),
                        help="what pytest runs against the sanitized backend (default: SERVED_TESTS)")
    args, pytest_args = parser.parse_known_args(argv)
    steps: list[Step] = []
    if not args.fuzz_only:
        steps.append(build_modules())
        built = steps[-1].ok
        if built and not args.served_only:
            steps.append(unit_tests(pytest_args))
        if built and not args.no_served:
            steps.append(served_backend(tuple(args.served_tests)))
    if not args.no_fuzz and not args.served_only:
        for name in args.targets:
            steps.append(fuzz(name, args.seconds))
    width = max(len(s.name) for s in steps)
    print("\nsanitizers and fuzzing (AddressSanitizer + UndefinedBehaviorSanitizer):")
    for s in steps:
        print(f"  {'ok  ' if s.ok else 'FAIL'}  {s.name:<{width}}  {s.seconds:6.1f} s  {s.detail}")
    failed = [s.name for s in steps if not s.ok]
    print(f"  {'FAILED: ' + ', '.join(failed) if failed else 'all clean'}  (logs in {BUILD.relative_to(ROOT)})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
