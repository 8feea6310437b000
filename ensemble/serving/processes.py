"""What the server's processes use, read from /proc: the process tree, CPU time, resident
memory, and which heavy frameworks a python-backend stub has loaded (Linux only)."""

from __future__ import annotations

import os
from pathlib import Path

# Shared objects whose presence in a process's memory map shows the framework was imported.
HEAVY_LIBRARIES = {"torch": "libtorch_cpu", "tensorflow": "libtensorflow_framework",
                   "xgboost": "libxgboost", "litert": "libLiteRt"}  # NVTabular imports torch and TensorFlow


def stat_fields(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (state is [0], ppid [1])."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def tree(root: int) -> list[int]:
    """``root`` and all its descendants (root first)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            children.setdefault(int(stat_fields(int(entry.name))[1]), []).append(int(entry.name))
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


def stub_pids(server_pid: int) -> dict[str, int]:
    """Model name -> pid of the python-backend stub serving it, under a tritonserver process."""
    found = {}
    for pid in tree(server_pid)[1:]:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        model_py = next((a.decode() for a in cmdline if a.endswith(b"model.py")), None)
        if model_py is not None:
            found[Path(model_py).parent.parent.name] = pid
    return found


def frameworks_loaded(pid: int) -> list[str]:
    """The keys of :data:`HEAVY_LIBRARIES` whose shared object is mapped into ``pid``."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text(errors="replace")
    except OSError:
        return []
    return sorted(name for name, marker in HEAVY_LIBRARIES.items() if marker in maps)
