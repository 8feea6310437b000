"""The parts of benchmarks.tables that run a release's row store in this process: the admission policies' hit
rates (``policies``), the cold read path against fio (``reads``), the hot tier warmed to its budget (``warm``)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from benchmarks.tables_keys import Keys, _zipf_top, rank_ids


def policies(repository: Path, out: Path, args) -> dict:
    """The admission policies' hit rate on unique keys, Zipf keys, at the hot tier's real size in rows: a copy of
    one DLRM's tables with 4-wide rows (the same rows per table, the same ids; read through the page cache),
    so that a long run of requests costs seconds, not the disk's hours. Each policy's Store runs the same key
    sequence; the hit rate of every block of requests is reported, to see when it holds still."""
    from ensemble.native import _tables
    from ensemble.tables import files

    keys = Keys(repository, args.release, "zipf", args.alpha)
    manifest = keys.manifest
    scratch = out / "policy-tables"
    scratch.mkdir(parents=True, exist_ok=True)
    specs = []
    for t in manifest.tables:
        path = scratch / f"{t.name}.rows"
        if not path.is_file() or files.read_header(path).rows != t.rows:
            files.write_table(path, t.rows, 4, "int8", t.seed)
        specs.append((t.name, str(path), t.rows, 4, t.small, None, None))
    real_slot = files.row_bytes(manifest.format, manifest.dim) + 9
    slots = int(args.cache_gib * 2**30 / 2 / real_slot)  # one DLRM's share of the budget, in rows
    budget = slots * (files.row_bytes("int8", 4) + 9)
    found = {"slots": slots, "requests_per_block": args.policy_block, "blocks": args.policy_blocks}
    start_state = keys.rng.bit_generator.state  # every policy sees the same keys
    for policy in ("always", "second", "none"):
        keys.rng.bit_generator.state = start_state
        store = _tables.Store(specs, budget, policy, "mmap", 32)
        out_rows = np.empty((100, len(specs), 4), np.float32)
        trace = []
        big = {t.name for t in manifest.tables if not t.small}
        for block in range(args.policy_blocks):
            before = store.stats()["tables"]
            for _ in range(args.policy_block):
                store.gather(keys.ids(100), out_rows)
            after = store.stats()["tables"]
            u = sum(after[n]["unique"] - before[n]["unique"] for n in after)
            h = sum(after[n]["hits"] - before[n]["hits"] for n in after)
            ub = sum(after[n]["unique"] - before[n]["unique"] for n in big)
            hb = sum(after[n]["hits"] - before[n]["hits"] for n in big)
            trace.append({"requests": (block + 1) * args.policy_block, "hit_rate": h / u, "hit_rate_large_tables": hb / ub,
                          "hot_rows": store.stats()["hot_rows"]})
            print(policy, trace[-1], flush=True)
        found[policy] = trace
    return found


def reads(repository: Path, args) -> dict:
    """The cold read path's cost a block: ``Store.gather`` of mostly cold rows, each queue depth in turn,
    alternating (fio's microseconds a block at that depth are set beside them once fio has run)."""
    import dataclasses

    from ensemble.scoring.pipeline import release_versions
    from ensemble.tables import serving
    from ensemble.tables.files import TablesManifest

    step = next(f for m, f in release_versions(repository, args.release).items() if m.value == "dlrm_torch")
    manifest = TablesManifest.load(step)
    keys = Keys(repository, args.release, "zipf", args.alpha, seed=5)
    points = []
    for turn in range(args.read_turns):
        for depth in args.read_depths:
            settings = dataclasses.replace(serving.Settings.from_environment(), io="uring", depth=depth,
                                           admission="none")
            store = serving.open_store(step, manifest, 1 << 20, settings)
            times = []
            for _ in range(args.read_calls):
                ids = np.ascontiguousarray(keys.ids(args.read_rows))
                out = np.empty((len(ids), ids.shape[1], manifest.dim), np.float32)
                start = time.perf_counter()
                store.gather(ids, out)
                times.append(time.perf_counter() - start)
            blocks = sum(t.get("cold_blocks", 0) for t in store.stats()["tables"].values())
            point = {"turn": turn + 1, "depth": depth, "calls": args.read_calls, "blocks_per_call": blocks / args.read_calls,
                     "p50_ms_per_call": float(np.median(times)) * 1e3, "us_per_block": sum(times) / blocks * 1e6}
            points.append(point)
            print(f"reads depth {depth} turn {turn + 1}: {point['blocks_per_call']:.0f} blocks a call, "
                  f"{point['us_per_block']:.1f} us a block", flush=True)
    return {"step": str(step), "rows_per_call": args.read_rows, "tier_bytes": 1 << 20, "points": points}


def _write_warm_file(folder: Path, step: Path, manifest, n: int, alpha: float) -> tuple[Path, Path]:
    """A warm file of ``n`` rows (the Zipf keys' likeliest rows of the step's large tables, most likely first),
    as the export writes one from training's counts: read from the release's table files, written in chunks."""
    import os

    from ensemble.tables import files

    big = [c for c, t in enumerate(manifest.tables) if not t.small]
    which, ranks = _zipf_top([manifest.tables[c].rows for c in big], n, 1.05 if alpha is None else alpha)
    keys = np.empty(len(ranks), np.int64)
    encoded = np.empty((len(ranks), files.row_bytes(manifest.format, manifest.dim)), np.uint8)
    for i, c in enumerate(big):
        at = np.nonzero(which == i)[0]
        ids = rank_ids(ranks[at], manifest.tables[c].rows)
        keys[at] = (np.int64(c) << files.KEY_SHIFT) | ids
        order = np.argsort(ids)
        encoded[at[order]] = files.read_encoded(step / manifest.tables[c].file, ids[order])
        print(f"warm file {step.parent.name}: {manifest.tables[c].name} {len(at):,} rows", flush=True)
    folder.mkdir(parents=True, exist_ok=True)
    rows_path, keys_path = folder / files.WARM_ROWS, folder / files.WARM_KEYS
    t = files._native()
    per = files.per_block(manifest.format, manifest.dim)
    chunk = per * 8192
    with open(rows_path, "wb") as out:
        out.write(t.header(manifest.format, manifest.dim, len(encoded), 0))
        for start in range(0, len(encoded), chunk):
            part = np.ascontiguousarray(encoded[start:start + chunk])
            blocks = np.empty((-(-len(part) // per), files.BLOCK), np.uint8)
            t.pack(part, encoded.shape[1], start // per, blocks)
            out.write(blocks.tobytes())
        out.flush()
        os.fsync(out.fileno())
    np.save(keys_path, keys)
    return rows_path, keys_path


def warm(repository: Path, args) -> dict:
    """The hot tier filled to its budget from a warm file at load: both DLRMs' stores opened as the server
    opens them (each its share of ``--cache-gib``), each warmed on its own thread as the server's steps do,
    from a warm file holding ``--warm-fill`` times the tier's slots of the Zipf keys' likeliest rows (the file
    training's counts give once training has touched that many rows), read from the disk (the file's pages
    dropped from the page cache first). Seconds until each tier stops filling, rows/s, the fill sampled."""
    import os
    import threading

    from ensemble.scoring.pipeline import release_versions
    from ensemble.tables import files, serving
    from ensemble.tables.files import TablesManifest

    budget = int(args.cache_gib * 2**30)
    settings = serving.Settings.from_environment()
    steps = {m.value: f for m, f in release_versions(repository, args.release).items() if files.has_tables(f)}
    stores, paths = {}, {}
    for name, step in steps.items():
        manifest = TablesManifest.load(step)
        share = serving.budget_share(name, manifest, serving._siblings(step, name))
        stores[name] = serving.open_store(step, manifest, int(budget * share), settings)
        slots = stores[name].stats()["hot_capacity_rows"]
        folder = Path(args.warm_scratch) / f"{name}-{step.name}-{slots}-{args.warm_fill}"
        if not (folder / files.WARM_KEYS).is_file():
            _write_warm_file(folder, step, manifest, int(slots * args.warm_fill), args.alpha)
        paths[name] = (folder / files.WARM_ROWS, folder / files.WARM_KEYS)
    for rows_path, _ in paths.values():  # read from the disk, not the page cache
        fd = os.open(rows_path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    done: dict[str, float] = {}
    start = time.perf_counter()

    def run(name: str) -> None:
        rows_path, keys_path = paths[name]
        stores[name].warm(str(rows_path), np.load(keys_path))
        done[name] = time.perf_counter() - start

    threads = [threading.Thread(target=run, args=(name,)) for name in stores]
    for thread in threads:
        thread.start()
    trace = []
    while any(thread.is_alive() for thread in threads):
        time.sleep(1.0)
        hot = sum(s.stats()["hot_bytes"] for s in stores.values())
        trace.append({"seconds": round(time.perf_counter() - start, 1), "hot_gib": hot / 2**30})
        print(f"warm {trace[-1]['seconds']:6.1f} s: hot tier {trace[-1]['hot_gib']:.2f} GiB", flush=True)
    for thread in threads:
        thread.join()
    result = {"budget_gib": args.cache_gib, "warm_fill": args.warm_fill, "steps": {}, "trace": trace,
              "seconds": max(done.values())}
    for name, store in stores.items():
        st = store.stats()
        size = paths[name][0].stat().st_size
        result["steps"][name] = {
            "seconds": done[name], "warm_file_bytes": size, "rows_put": st["warmed_rows"],
            "hot_rows": st["hot_rows"], "slots": st["hot_capacity_rows"], "filled": st["hot_rows"] / st["hot_capacity_rows"],
            "hot_gib": st["hot_bytes"] / 2**30, "rows_per_s": st["warmed_rows"] / done[name],
            "file_mb_per_s": size / done[name] / 1e6}
        print(f"warm {name}: {st['hot_rows']:,} of {st['hot_capacity_rows']:,} slots "
              f"({st['hot_rows'] / st['hot_capacity_rows']:.1%}) in {done[name]:.1f} s, "
              f"{st['warmed_rows'] / done[name]:,.0f} rows/s, {size / done[name] / 1e6:.0f} MB/s of file", flush=True)
    return result
