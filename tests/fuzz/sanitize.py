"""The C code that reads client bytes, under AddressSanitizer and UndefinedBehaviorSanitizer.

1. Builds every extension module with ``-fsanitize=address,undefined`` (gcc, setup.py's own flags
   otherwise) into ``build/sanitize/lib``, next to a copy of the package's Python files; the modules in
   the source tree are left as they are.
2. Runs the unit tests of the C paths on those modules (``tests/fuzz/sanitized_modules.py`` puts them
   first), with gcc's libasan preloaded into Python.
3. Builds each fuzz target of ``tests/fuzz/targets`` with clang's libFuzzer (plus both sanitizers) and
   runs it for ``--seconds`` from its committed seeds in ``tests/fuzz/corpus/<target>``; what it finds
   on the way is kept in ``build/sanitize/corpus`` and a crashing input in ``build/sanitize/crashes``.

Any sanitizer report, fuzz check or crash fails the run; it ends with one summary table.

    .venv/bin/python -m tests.fuzz.sanitize                   # what `make test` runs (25 s a target)
    .venv/bin/python -m tests.fuzz.sanitize --seconds 600 --fuzz-only   # a longer run
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
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build" / "sanitize"
LIB = BUILD / "lib"
TARGETS = ROOT / "tests" / "fuzz" / "targets"
CORPUS = ROOT / "tests" / "fuzz" / "corpus"
MODULES = ("ensemble.native._request", "ensemble.native._chain", "ensemble.native._admission",
           "ensemble.native._trees", "ensemble.native._dlrm", "ensemble.native._openvino")
# The unit tests that run the C modules (the native backend's checks are fuzzed, not unit-tested here).
UNIT_TESTS = ("tests/unit/test_native.py", "tests/unit/test_chain.py", "tests/unit/test_admission.py",
              "tests/unit/test_embedded.py", "tests/unit/test_c_hostile.py",
              "tests/unit/test_models.py::test_the_c_forward_pass_reads_both_exported_dlrms_and_gives_their_scores",
              "tests/unit/test_models.py::test_the_c_interaction_gives_pairs_in_any_order_the_same_sums",
              "tests/unit/test_models.py::test_the_avx512_build_gives_the_avx2_builds_floats",
              "tests/unit/test_models.py::test_tree_arrays_equal_xgboost_with_missing_values_on_every_batch_size",
              "tests/unit/test_engines.py::test_the_openvino_engine_scores_as_the_framework_and_refuses_ids_outside_the_tables")
FUZZ_TARGETS = ("split_wire", "lookup_wire", "dense_prepare", "tsv_to_wire", "plain_checks", "release")
SANITIZE = "-fsanitize=address,undefined"
REPORT = re.compile(r"ERROR: AddressSanitizer|runtime error:|ERROR: libFuzzer|fuzz check failed|SUMMARY: ")
SANITIZER_ENV = {
    "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:halt_on_error=1",
    "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
    # oneTBB (under OpenVINO, which the tests' exports measure) opens its hwloc binding with RTLD_DEEPBIND
    # unless this is set, and ASan aborts a process that does
    "TBB_ENABLE_SANITIZERS": "1",
}


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
    env = dict(os.environ, CC="gcc", CFLAGS=f"{SANITIZE} -fno-sanitize-recover=all -fno-omit-frame-pointer -g",
               LDFLAGS=SANITIZE)
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
    preload = " ".join(subprocess.run(["gcc", f"-print-file-name={lib}"], capture_output=True, text=True).stdout.strip()
                       for lib in ("libasan.so", "libstdc++.so"))
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


def _python_link() -> list[str]:
    config = sysconfig.get_config_vars()
    return [f"-I{sysconfig.get_paths()['include']}", f"-L{config['LIBDIR']}", f"-lpython{config['LDVERSION']}",
            f"-Wl,-rpath,{config['LIBDIR']}"]


def build_target(name: str) -> tuple[Path | None, str]:
    binary = BUILD / "fuzz" / name
    binary.parent.mkdir(parents=True, exist_ok=True)
    code, output = _run(["clang", "-g", "-O1", f"{SANITIZE},fuzzer", "-fno-sanitize-recover=all", "-Wall", "-Wextra",
                         "-Werror", "-Wno-unused-parameter", f"-I{ROOT / 'ensemble'}", str(TARGETS / f"{name}.c"),
                         "-o", str(binary), *_python_link()], log=BUILD / "fuzz" / f"{name}.build.log")
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
    parser.add_argument("--fuzz-only", action="store_true", help="no sanitized module build or unit tests")
    parser.add_argument("--no-fuzz", action="store_true", help="only the sanitized modules and their unit tests")
    args, pytest_args = parser.parse_known_args(argv)
    steps: list[Step] = []
    if not args.fuzz_only:
        steps.append(build_modules())
        if steps[-1].ok:
            steps.append(unit_tests(pytest_args))
    if not args.no_fuzz:
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
