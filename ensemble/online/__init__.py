"""The online feature store: each entity's latest features in Redis, read when a ranking request
names a user and item ids instead of sending their features.

Layout in the store (one dataset spec per key prefix, ``ensemble:<spec name>``):

- ``<prefix>:meta``: JSON describing the stored rows (per side: its key column, the key's index in the
  side's categorical values, how many continuous and categorical values a row holds), written by
  ``ensemble materialize``; the server checks it against the ranker's widths before the first lookup.
- ``<prefix>:context:<id>`` and ``<prefix>:candidate:<id>``: one entity's row (:func:`encode_row`):
  its freshness (the spec's time column of the latest row materialized, seconds since the epoch),
  its side's continuous values as float32 and its categorical values as bytes, exactly the values a
  ranking request with inline features carries for it (the key's own value included).

A lookup (:class:`FeatureLookup`) reads whatever its in-process cache (bounded in entries, each kept
at most ``ttl_s``) does not hold with one ``MGET`` (Redis Cluster: one pipelined ``MGET`` per node),
and builds the four tensors of the equivalent inline request. Every unusual case is counted by
reason (:data:`REASONS`).

The package: :mod:`~ensemble.online.codec` (keys and the row format), :mod:`~ensemble.online.transport` (the
connection and its round trip), :mod:`~ensemble.online.redis_adapter` (redis-py's private API, pinned),
:mod:`~ensemble.online.lookup` (the lookup, its cache and settings), :mod:`~ensemble.online.materialize`
(``ensemble materialize``) and :mod:`~ensemble.online.local` (a local Redis or Redis Cluster for the demos and
tests).
"""

from ensemble.online.codec import CANDIDATE, CONTEXT, Side, decode_row, encode_row, entity_key, meta_key, prefix
from ensemble.online.lookup import ENV, REASONS, STALE, UNKNOWN_ITEMS, FeatureLookup, Rows, StoreSettings, Unservable
from ensemble.online.transport import StoreError, connect, mget, redacted

__all__ = ["CANDIDATE", "CONTEXT", "ENV", "REASONS", "STALE", "UNKNOWN_ITEMS", "FeatureLookup", "Rows", "Side",
           "StoreError", "StoreSettings", "Unservable", "connect", "decode_row", "encode_row", "entity_key", "mget",
           "meta_key", "prefix", "redacted"]
