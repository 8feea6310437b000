"""The python backend's shared-memory files that killed processes leave behind."""

import mmap
import os
import subprocess
import time

from ensemble.operate import processes


def _region(folder, name: str):
    path = folder / f"{processes.SHM_REGION_PREFIX}{name}"
    path.write_bytes(b"\0" * 4096)
    return path


def test_only_unmapped_regions_created_since_the_start_are_removed(tmp_path):
    before = time.time() - 1.0
    dead, live = _region(tmp_path, "dead"), _region(tmp_path, "live")
    other = tmp_path / "not-a-region"
    other.write_bytes(b"\0")
    with open(live, "r+b") as f, mmap.mmap(f.fileno(), 4096):
        assert live.name in processes.shm_regions([os.getpid()])
        # too young: a starting server may not have mapped it yet
        assert processes.remove_orphan_regions(since=before, min_age=60.0, shm_dir=tmp_path) == []
        # created before the server started: not its own
        assert processes.remove_orphan_regions(since=time.time() + 1.0, min_age=0.0, shm_dir=tmp_path) == []
        assert dead.exists()
        assert processes.remove_orphan_regions(since=before, min_age=0.0, shm_dir=tmp_path) == [dead.name]
        assert not dead.exists() and live.exists() and other.exists()  # a mapped one stays
    assert processes.remove_orphan_regions(since=before, min_age=0.0, shm_dir=tmp_path) == [live.name]


def test_a_killed_servers_regions_are_removed_once_its_exiting_processes_let_go(tmp_path):
    """What ``TritonServer.kill`` does with the files its stubs mapped: each is removed as soon as no
    process maps it, even a young one, and one a process still maps after the wait is left."""
    import threading

    held, young, gone = _region(tmp_path, "held"), _region(tmp_path, "young"), tmp_path / "never-there"
    with open(held, "r+b") as f:
        view = mmap.mmap(f.fileno(), 4096)
        names = {held.name, young.name, gone.name}
        assert processes.remove_when_unmapped(names, wait_s=0.2, shm_dir=tmp_path) == [young.name]
        assert held.exists() and not young.exists()  # still mapped when the wait ended
        threading.Timer(0.3, view.close).start()  # a process that exits a moment later
        started = time.monotonic()
        assert processes.remove_when_unmapped({held.name}, wait_s=5.0, shm_dir=tmp_path) == [held.name]
        assert 0.25 < time.monotonic() - started < 4.0 and not held.exists()


def test_a_process_group_includes_its_live_members_only():
    child = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert processes.group(child.pid) == [child.pid]
        assert child.pid not in processes.group(os.getpgrp())
        child.kill()
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
        assert processes.stat_fields(child.pid)[0] == "Z"
        assert processes.group(child.pid) == []
    finally:
        child.kill()
        child.wait()
