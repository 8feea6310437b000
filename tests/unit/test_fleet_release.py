"""Finding a running fleet from its gateway's address (the record ``ensemble serve --replicas`` writes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ensemble.fleet import release
from ensemble.operate import records
from ensemble.fleet.gateway import Gateway, Replica

GATEWAY = Gateway((Replica(18100, 18101, "127.0.0.1"), Replica(18102, 18103, "127.0.0.1")), http_port=18000,
                  grpc_port=18001, admin_port=18002, release=5, routes_dir="/tmp/routes")


def test_a_recorded_fleet_is_found_by_its_gateway_port_while_its_process_lives(tmp_path, monkeypatch):
    monkeypatch.setenv(records.RUN_DIR_ENV, str(tmp_path))
    assert release.find("127.0.0.1:18000") is None
    path = release.record(GATEWAY, tmp_path / "repo", "native", 4)
    found = release.find("http://127.0.0.1:18000/")
    assert found is not None and found.gateway == GATEWAY and found.layout == "native" and found.pid == os.getpid()
    assert found.release == 4 and found.repository == str((tmp_path / "repo").resolve())
    assert [c.url for c in found.replicas()] == ["http://127.0.0.1:18100", "http://127.0.0.1:18102"]
    assert [c.grpc_url for c in found.replicas()] == ["127.0.0.1:18101", "127.0.0.1:18103"]
    assert release.find("127.0.0.1:18001") is None and release.find("no-port") is None
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "pid": int(ended.stdout)}))
    assert release.find("127.0.0.1:18000") is None  # its process has ended
    release.record(GATEWAY, tmp_path / "repo", "native", 4)
    release.forget(GATEWAY)
    assert not path.exists()
