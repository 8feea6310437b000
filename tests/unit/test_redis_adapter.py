"""The online store's use of redis-py's private API stays in ensemble/online/redis_adapter.py, written for the
versions installed here; its packed MGET answers as redis-py's own against a real redis-server."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest

from ensemble.online import redis_adapter
from tests.helpers import lines_matching, requirement_pins

ROOT = Path(__file__).resolve().parents[2]
# redis-py's connection-pool and connection calls that are not its documented API
PRIVATE = re.compile(r"\.(get_connection|send_packed_command|read_response|send_command)\(")


def test_the_adapter_was_written_for_the_installed_versions():
    """Fails on an upgrade of redis or hiredis: read ensemble/online/redis_adapter.py against the new version,
    then change WRITTEN_FOR and requirements.txt together."""
    assert {name: metadata.version(name) for name in redis_adapter.WRITTEN_FOR} == redis_adapter.WRITTEN_FOR


def test_requirements_pin_the_versions_the_adapter_was_written_for():
    assert requirement_pins(ROOT, redis_adapter.WRITTEN_FOR) == redis_adapter.WRITTEN_FOR


def test_no_other_module_touches_redis_pys_private_api():
    assert lines_matching(ROOT, "redis_adapter.py", lambda line: PRIVATE.search(line) is not None) == []


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
