"""The online store's use of redis-py's private API stays in ensemble/online/redis_adapter.py, written for the
versions installed here; its packed MGET answers as redis-py's own against a real redis-server."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest

from ensemble.online import redis_adapter

ROOT = Path(__file__).resolve().parents[2]
# redis-py's connection-pool and connection calls that are not its documented API
PRIVATE = re.compile(r"\.(get_connection|send_packed_command|read_response|send_command)\(")


def test_the_adapter_was_written_for_the_installed_versions():
    """Fails on an upgrade of redis or hiredis: read ensemble/online/redis_adapter.py against the new version,
    then change WRITTEN_FOR and requirements.txt together."""
    assert {name: metadata.version(name) for name in redis_adapter.WRITTEN_FOR} == redis_adapter.WRITTEN_FOR


def test_requirements_pin_the_versions_the_adapter_was_written_for():
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)(?:\[[^]]*\])?==(\S+)", (ROOT / "requirements.txt").read_text(), re.M))
    assert {name: pins.get(name) for name in redis_adapter.WRITTEN_FOR} == redis_adapter.WRITTEN_FOR


def test_no_other_module_touches_redis_pys_private_api():
    offenders = [f"{path.relative_to(ROOT)}:{number}"
                 for folder in ("clients", "loadtest", "benchmarks", "ensemble")
                 for path in sorted((ROOT / folder).rglob("*.py")) if path.name != "redis_adapter.py"
                 for number, line in enumerate(path.read_text().splitlines(), 1)
                 if PRIVATE.search(line.split("#")[0])]
    assert offenders == []


def test_the_packed_mget_answers_as_redis_pys_own_and_drops_a_broken_connection(tmp_path):
    import redis

    from ensemble.online.local import LocalRedis, StoreServerError
    from ensemble.base.machine import free_port

    try:
        store = LocalRedis(free_port(), tmp_path).start()
    except (StoreServerError, FileNotFoundError) as exc:
        pytest.fail(f"make test installs redis-server: {exc}")
    try:
        client = redis.Redis.from_url(store.url)
        client.mset({b"a": b"1", b"b": b"\x00\xff binary"})
        keys = [b"a", b"missing", b"b", b"a"]
        assert redis_adapter.packed_mget(client, keys) == client.mget(keys) == [b"1", None, b"\x00\xff binary", b"1"]
        store.kill()  # the store vanishes: the call fails, and the connection it took goes back closed
        with pytest.raises((redis.ConnectionError, OSError)):
            redis_adapter.packed_mget(client, keys)
        assert all(c._sock is None for c in client.connection_pool._available_connections)
    finally:
        store.stop()
