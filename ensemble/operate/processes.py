"""What the server's processes use, read from /proc: the process tree, CPU time, resident
memory, which heavy frameworks a python-backend stub has loaded, and the shared memory that killed
processes leave behind (Linux only)."""

from __future__ import annotations

import os
import time
from pathlib import Path

# Shared objects whose presence in a process's memory map shows the framework was imported.
HEAVY_LIBRARIES = {"torch": "libtorch_cpu", "tensorflow": "libtensorflow_framework",
                   "xgboost": "libxgboost", "litert": "libLiteRt"}  # NVTabular imports torch and TensorFlow


def stat_fields(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (state is [0], ppid [1])."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def pids() -> list[int]:
    """Every process's id."""
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def tree(root: int) -> list[int]:
    """``root`` and all its descendants (root first)."""
    children: dict[int, list[int]] = {}
    for pid in pids():
        try:
            children.setdefault(int(stat_fields(pid)[1]), []).append(pid)
        except (OSError, IndexError, ValueError):
            continue
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    return found


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (all its threads); 0.0 if it is gone."""
    try:
        fields = stat_fields(pid)
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss(pid: int) -> int:
    """Resident memory in bytes; 0 if the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def arguments_ending(root: int, suffix: str) -> dict[int, str]:
    """pid -> the first command-line argument ending in ``suffix``, for every process below ``root``
    that has one."""
    found = {}
    for pid in tree(root)[1:]:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        argument = next((a.decode() for a in cmdline if a.endswith(suffix.encode())), None)
        if argument is not None:
            found[pid] = argument
    return found


def stub_pids(server_pid: int) -> dict[str, int]:
    """Model name -> pid of the python-backend stub serving it, under a tritonserver process."""
    return {Path(model_py).parent.parent.name: pid for pid, model_py in arguments_ending(server_pid, "model.py").items()}


def frameworks_loaded(pid: int) -> list[str]:
    """The keys of :data:`HEAVY_LIBRARIES` whose shared object is mapped into ``pid``."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text(errors="replace")
    except OSError:
        return []
    return sorted(name for name, marker in HEAVY_LIBRARIES.items() if marker in maps)


def remove_if_empty(folder: Path) -> None:
    """Remove ``folder`` when nothing is left in it (a process's scratch folder whose log lives elsewhere)."""
    try:
        folder.rmdir()
    except OSError:
        pass  # something stays: a log


def group(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``: a server started in a session of
    its own and its backend processes, even those a dead server left as orphans."""
    found = []
    for pid in pids():
        try:
            fields = stat_fields(pid)
            if int(fields[2]) == pgid and fields[0] != "Z":
                found.append(pid)
        except (OSError, IndexError, ValueError):
            continue
    return found


SHM_DIR = Path("/dev/shm")
# Triton's python backend passes each stub's requests through a file of this name in SHM_DIR,
# which tritonserver creates and keeps mapped for as long as it runs.
SHM_REGION_PREFIX = "triton_python_backend_shm_region_"


def shm_regions(of: list[int] | None = None) -> set[str]:
    """Names of the python backend's shared-memory files that the processes ``of`` (None: every
    process this user may look at) map."""
    found = set()
    for pid in pids() if of is None else of:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text(errors="replace")
        except OSError:
            continue
        if SHM_REGION_PREFIX in maps:
            found.update(line.rsplit("/", 1)[-1].split()[0] for line in maps.splitlines() if SHM_REGION_PREFIX in line)
    return found


def remove_when_unmapped(names: set[str], wait_s: float = 10.0, shm_dir: Path = SHM_DIR) -> list[str]:
    """Delete each of the python backend's shared-memory files ``names`` once no process maps it,
    waiting up to ``wait_s`` for the processes that still do to exit; returns the names deleted (a
    file still mapped after the wait is left)."""
    pending, removed = set(names), []
    deadline = time.monotonic() + wait_s
    while pending:
        mapped = shm_regions()
        for name in sorted(pending - mapped):
            pending.discard(name)
            try:
                (shm_dir / name).unlink()
                removed.append(name)
            except FileNotFoundError:
                continue  # removed meanwhile (by Triton, on a clean exit)
            except OSError:
                continue
        if pending and time.monotonic() < deadline:
            time.sleep(0.05)
        else:
            break
    return removed


def remove_orphan_regions(since: float, min_age: float = 0.5, shm_dir: Path = SHM_DIR) -> list[str]:
    """Delete the python backend's shared-memory files that no process maps any more, that this
    user owns and that were created (ctime, wall clock) at or after ``since`` and at least
    ``min_age`` seconds ago; returns the names deleted.

    Triton deletes its regions when it exits cleanly, but not those of a process killed with
    SIGKILL (a restarted server's, a healed stub's): each holds its memory (1 MiB or more, in
    tmpfs) until deleted. A live server keeps every region of its stubs mapped, so a file no
    process maps belongs to no running server; ``min_age`` keeps away from one a starting server
    has created but not mapped yet."""
    try:
        candidates = [path for path in shm_dir.iterdir() if path.name.startswith(SHM_REGION_PREFIX)]
    except OSError:
        return []
    now, uid = time.time(), os.getuid()
    old_enough = []
    for path in candidates:
        try:
            info = path.stat()
        except OSError:
            continue
        if info.st_uid == uid and since <= info.st_ctime <= now - min_age:
            old_enough.append(path)
    if not old_enough:
        return []
    mapped = shm_regions()
    removed = []
    for path in old_enough:
        if path.name in mapped:
            continue
        try:
            path.unlink()
            removed.append(path.name)
        except OSError:
            continue  # gone meanwhile
    return sorted(removed)
