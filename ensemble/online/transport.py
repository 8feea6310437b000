"""The online store's connection: a client of its URL (one node or a Redis Cluster), its errors, and the
one round trip a lookup makes (``MGET``)."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

class StoreError(Exception):
    """The store did not answer in time or could not be reached (503 / UNAVAILABLE, naming it)."""



def redacted(url: str) -> str:
    """The store's URL without its password (what errors and logs name)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username + ':' if parts.username else ''}***@{host}{f':{parts.port}' if parts.port else ''}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def connect(url: str, timeout_s: float = 1.0):
    """A client of the store at ``url`` (``redis://`` or ``rediss://``, with auth), in cluster mode when
    the server says it is a cluster node. No retries: a failure is answered at once, not after backoff."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    options = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0),
                   health_check_interval=0)
    single = redis.Redis.from_url(url, **options)
    try:
        clustered = single.info("cluster").get("cluster_enabled") == 1
    except redis.RedisError as exc:
        single.close()
        raise StoreError(f"the feature store {redacted(url)} is unreachable: {exc}") from None
    if not clustered:
        return single
    single.close()
    from redis.cluster import RedisCluster

    return RedisCluster.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                 retry=Retry(NoBackoff(), 0))



def mget(client, keys: list[bytes]) -> list[bytes | None]:
    """The values of ``keys`` in one round trip per store node."""
    if not keys:
        return []
    if hasattr(client, "mget_nonatomic"):  # a cluster client: one pipelined MGET per node
        return client.mget_nonatomic(keys)
    try:
        import hiredis  # noqa: F401 - the adapter's packer
    except ImportError:  # pragma: no cover - pinned beside redis in requirements.txt
        return client.mget(keys)
    from ensemble.online.redis_adapter import packed_mget

    return packed_mget(client, keys)
