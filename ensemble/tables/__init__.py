"""Embedding tables larger than memory: the row store, its files, training's rows and the hot tier.

A DLRM whose tables are large (any table of :data:`SMALL_ROWS` rows or more, such as the DLRM seed's
``criteo-1tb`` shape: 204M rows per DLRM) keeps them out of the model: training reads and updates
only a batch's rows (:mod:`ensemble.tables.training`), the export writes every row of every table
into files of its own (:mod:`ensemble.tables.files`: 4 KiB blocks with a checksum each, fp16 or
8-bit rowwise), and the native layout serves them from a hot tier in RAM and the local disk
(:mod:`ensemble.tables.serving`, the C in ``ensemble/native/_tables.c``). The MLPs keep their engine
and take the gathered rows as inputs.

Tiers, per DLRM (the budget is the server's ``--embedding-cache-gib``, split between the DLRMs):

- small tables (fewer than :data:`SMALL_ROWS` rows): read whole into RAM at load, in their format;
- the hot tier: large tables' rows up to the budget, warmed at load from the rows training touched
  most (read sequentially), then filled on misses as the admission policy says;
- the disk: every row of every large table, read one 4 KiB block at a time (O_DIRECT), deduplicated
  per request, through io_uring with a bounded queue depth.
"""

# A table with fewer rows stays in RAM whole (the criteo-1tb shape's 20 tables under 1M rows: ~1.1M rows).
SMALL_ROWS = 1_000_000
