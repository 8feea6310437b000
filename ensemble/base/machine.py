"""The machine: what a measurement ran on, and the system packages the project's commands need.

Every reported figure names its machine (:func:`summary`): the CPU by model name, family and model
number, and the instruction-set flags that change this project's speed (``avx512_vp2intersect`` and
AMX separate CPUs that /proc/cpuinfo calls by the same name).

The Debian packages ``make setup``, ``make demo`` and ``make test`` need are listed here, once
(:data:`PACKAGES`); ``python -m ensemble.base.machine packages --for test --install`` (what the Makefile
runs, with the system's Python, before the virtual environment exists) installs the missing ones
with apt-get when it runs as root, and otherwise stops with the one command that would.

Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import os
import threading
import platform
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# The instruction-set flags that change what this project's kernels and engines run (AVX-512 paths
# in the DLRM's C pass and OpenVINO's int8 and bf16 kernels).
FLAGS_THAT_MATTER = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_vp2intersect", "avx_vnni",
                     "amx_tile", "amx_bf16", "amx_int8")


def cpu() -> dict:
    """The CPU: ``name`` (model name), ``family`` and ``model`` numbers, ``flags`` (those of
    :data:`FLAGS_THAT_MATTER` it has, in that order)."""
    found = {"name": "unknown CPU", "family": None, "model": None, "flags": []}
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key == "model name" and found["name"] == "unknown CPU":
                found["name"] = value
            elif key == "cpu family" and found["family"] is None:
                found["family"] = int(value)
            elif key == "model" and found["model"] is None:
                found["model"] = int(value)
            elif key == "flags" and not flags:
                flags = set(value.split())
            elif not line.strip() and flags:
                break  # the first processor is described; the others repeat it
    except (OSError, ValueError):
        pass
    found["flags"] = [f for f in FLAGS_THAT_MATTER if f in flags]
    return found


def cpu_label(found: dict | None = None) -> str:
    """``AMD EPYC (family 25 model 17; avx2 fma avx512f ...)``: the name alone does not tell CPUs apart."""
    c = found or cpu()
    number = f"family {c['family']} model {c['model']}" if c["family"] is not None else "family unknown"
    return f"{c['name']} ({number}; {' '.join(c['flags']) or 'no AVX2'})"


def describe() -> dict:
    """Architecture, usable cores, the CPU (:func:`cpu`), memory (GiB); no GPU is used by this project's runs."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    c = cpu()
    return {"arch": platform.machine(), "cores": len(os.sched_getaffinity(0)), "cpu": c["name"],
            "cpu_family": c["family"], "cpu_model": c["model"], "cpu_flags": c["flags"],
            "memory_gib": round(memory), "gpu": "none"}


def summary() -> str:
    m = describe()
    return f"{m['arch']}, {m['cores']} cores ({cpu_label()}), {m['memory_gib']} GiB, no GPU"


# ---- system packages -------------------------------------------------------------------------

@dataclass(frozen=True)
class Package:
    """A Debian package: ``present()`` checks what the project uses of it (a command, a library, a
    header), not the package database, so a machine that has it some other way passes too."""

    name: str
    why: str
    needed_by: tuple[str, ...]  # the make targets: setup (and so demo and test), demo, test
    command: str | None = None
    library: str | None = None  # a soname, looked up with ldconfig
    file: str | None = None  # a path, or "python-headers"

    def present(self) -> bool:
        if self.command is not None:
            return shutil.which(self.command) is not None
        if self.library is not None:
            return _has_library(self.library)
        if self.file == "python-headers":
            return (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file()
        if self.file == "ensurepip":
            try:
                import ensurepip  # noqa: F401 - Debian splits it out of python3.11 into python3.11-venv
            except ImportError:
                return False
            return True
        if self.file == "libfuzzer":
            return _has_libfuzzer()
        return Path(self.file or "/nonexistent").exists()


def _has_library(soname: str) -> bool:
    try:
        listed = subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return False
    return any(line.strip().startswith(soname + " ") for line in listed.splitlines())


def _has_libfuzzer() -> bool:
    """clang's libFuzzer runtime (``-fsanitize=fuzzer``), which the fuzz targets link."""
    if shutil.which("clang") is None:
        return False
    found = subprocess.run(["clang", "--print-file-name=libclang_rt.fuzzer-x86_64.a"], capture_output=True, text=True,
                           check=False).stdout.strip()
    return os.path.isabs(found) and Path(found).is_file()


SETUP, DEMO, TEST = "setup", "demo", "test"
PACKAGES = (
    Package("python3.11-venv", "`make setup` creates .venv with it", (SETUP,), file="ensurepip"),
    Package("libpython3.11", "the python backend's stub and the native backend embed Debian's libpython3.11",
            (SETUP,), library="libpython3.11.so.1.0"),
    Package("python3.11-dev", "Python's headers: the install compiles the C modules and the native backend",
            (SETUP,), file="python-headers"),
    Package("gcc", "the install compiles the C modules and the native backend", (SETUP,), command="gcc"),
    Package("zlib1g-dev", "zlib's headers: the row store's checksums and hashed columns' ids (CRC-32) in C", (SETUP,),
            file="/usr/include/zlib.h"),
    Package("liburing-dev", "io_uring's library: the row store reads cold rows through it (docs/tables.md)", (SETUP,),
            file="/usr/include/liburing.h"),
    Package("libhiredis-dev", "hiredis's headers: the row store's cold tier in a Redis Cluster (docs/fleet.md)", (SETUP,),
            file="/usr/include/hiredis/hiredis.h"),
    Package("libtcmalloc-minimal4", "`ensemble serve` runs tritonserver on tcmalloc (docs/serving.md#the-allocator)",
            (DEMO, TEST), library="libtcmalloc_minimal.so.4"),
    Package("redis-server", "the online store the tests of ranking by ids start", (TEST,), command="redis-server"),
    Package("clang", "libFuzzer: `make sanitize` builds the fuzz targets with it", (TEST,), command="clang"),
    Package("libclang-rt-14-dev", "clang's libFuzzer and sanitizer runtimes", (TEST,), file="libfuzzer"),
)


def needed(target: str) -> list[Package]:
    """The packages ``make <target>`` needs: setup's, plus the target's own."""
    return [p for p in PACKAGES if SETUP in p.needed_by or target in p.needed_by]


def _apt(*args: str) -> int:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    return subprocess.run(["apt-get", *args], env=env, check=False).returncode


def ensure_packages(target: str, install: bool) -> int:
    """0 when every package ``make <target>`` needs is present (after installing the missing ones
    as root with apt-get, when ``install``); else 1, having printed the one command that would."""
    missing = [p for p in needed(target) if not p.present()]
    if not missing:
        return 0
    names = " ".join(p.name for p in missing)
    for p in missing:
        print(f"make {target}: needs {p.name}: {p.why}", file=sys.stderr)
    can_install = install and os.geteuid() == 0 and shutil.which("apt-get") is not None
    if can_install:
        print(f"make {target}: apt-get install -y {names}", file=sys.stderr)
        code = _apt("install", "-y", "-q", "--no-install-recommends", *(p.name for p in missing))
        if code != 0:  # a fresh machine's package lists may be stale or empty
            _apt("update", "-q")
            code = _apt("install", "-y", "-q", "--no-install-recommends", *(p.name for p in missing))
        still = [p.name for p in missing if not p.present()]
        if code == 0 and not still:
            return 0
        print(f"make {target}: apt-get could not install {' '.join(still) or names}", file=sys.stderr)
        return 1
    if shutil.which("apt-get") is None:
        print(f"make {target}: install these Debian packages (or your system's equivalents): {names}", file=sys.stderr)
    else:
        print(f"make {target}: run `sudo apt-get install -y {names}`, then `make {target}` again", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ensemble.base.machine", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("packages", help="check (and as root, install) the Debian packages a make target needs")
    p.add_argument("--for", dest="target", choices=(SETUP, DEMO, TEST), default=TEST)
    p.add_argument("--install", action="store_true", help="as root with apt-get: install what is missing")
    sub.add_parser("describe", help="print the machine as figures name it")
    args = parser.parse_args(argv)
    if args.command == "describe":
        print(summary())
        return 0
    return ensure_packages(args.target, args.install)


if __name__ == "__main__":
    sys.exit(main())


# Ports this process has handed out. Each is free when picked but is bound only later, by whoever
# asked, so the system could hand it out again meanwhile: a process never hands a port out twice.
_HANDED_OUT: set[int] = set()
_HANDING_OUT = threading.Lock()


def free_port() -> int:
    """A port nothing listens on, never one this process handed out before."""
    return free_ports(1)[0]


def free_ports(count: int, avoid=()) -> list[int]:
    """``count`` different free ports, none in ``avoid`` (ports already promised to something that has
    not bound them yet) and none this process handed out before. Every socket stays bound until all
    are picked, so the system cannot give one port twice."""
    import socket

    held, ports = [], []
    with _HANDING_OUT:
        taken = _HANDED_OUT | set(avoid)
        try:
            while len(ports) < count:
                s = socket.socket()
                held.append(s)  # held even when refused, so the next bind gets another port
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
                if port not in taken:
                    ports.append(port)
        finally:
            for s in held:
                s.close()
        _HANDED_OUT.update(ports)
    return ports


def port_free(host: str, port: int) -> bool:
    """True when nothing listens on ``host:port`` (SO_REUSEADDR: a closed server's lingering
    connections do not count)."""
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
