"""Every use the online store makes of redis-py's private API, in one place.

A lookup sends ``MGET`` packed by hiredis in C on a pooled connection of redis-py's (redis-py's own
``mget`` packs its arguments in Python: ~20 us of 100 on a 100-key lookup here). That takes a pool's
connection and sends and reads on it with calls redis-py does not document. They were written against the
versions in :data:`WRITTEN_FOR`, which requirements.txt pins; ``tests/unit/test_redis_adapter.py`` fails
when the installed versions differ, so an upgrade means reading these few lines again, not a silent break.
"""

from __future__ import annotations

# The versions this module was written and tested against (requirements.txt pins the same).
WRITTEN_FOR = {"redis": "8.1.0", "hiredis": "3.4.2"}


def packed_mget(client, keys: list[bytes]) -> list[bytes | None]:
    """``MGET keys`` on one of ``client``'s pooled connections (a single-node ``redis.Redis``), the command
    packed by hiredis; the connection is dropped after any failure, as redis-py's own commands drop it."""
    import hiredis

    pool = client.connection_pool
    connection = pool.get_connection()
    try:
        connection.send_packed_command([hiredis.pack_command((b"MGET", *keys))], check_health=False)
        return connection.read_response()
    except BaseException:
        connection.disconnect()
        raise
    finally:
        pool.release(connection)
