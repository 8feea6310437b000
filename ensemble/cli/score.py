"""Commands that score through a server or in process: `score`, `rank`, `materialize` (the online store that
ranking by ids reads)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


# `ensemble.data.criteo` imports pandas (~0.4 s): imported inside the commands that use it, so that
# `--help` and argument errors answer at once.


from ensemble.cli.common import _command

def cmd_rank(args) -> int:
    from clients.inputs import ranking_tensors
    from clients.ranking_files import GroupError, rank_files
    from clients.triton import RankerClient, Ranking, Retry
    from ensemble import dataset

    if bool(args.local) == bool(args.url):
        print("error: give --url or --local (one of the two)", file=sys.stderr)
        return 2
    spec = dataset.load_spec(args.dataset)
    if args.ids and args.local:
        print("error: --ids needs a server with an online store (--url), not --local", file=sys.stderr)
        return 2
    ids_of = None
    if args.ids:  # the files carry ids only: the server reads the features from its online store
        from dataclasses import replace

        user_key, item_key = spec.key(dataset.Side.CONTEXT), spec.key(dataset.Side.CANDIDATE)
        if item_key is None:
            print(f"error: the {spec.name} spec names no [candidate] key: it cannot be ranked by ids", file=sys.stderr)
            return 2
        ids_of = spec
        spec = replace(spec, columns=tuple(c for c in spec.columns if c.name in (user_key, item_key)))
    if args.local:
        from ensemble.scoring.pipeline import Pipeline

        pipeline = Pipeline.from_repository(args.repository, threads=1)

        def rank(context, candidates, k):
            order, scores = pipeline.rank(*ranking_tensors(context, candidates, spec), k=k)
            return Ranking(order, scores)
    else:
        import threading

        RankerClient(args.url, args.protocol)  # a malformed --url fails here, before any work
        local = threading.local()

        def rank(context, candidates, k):  # one client per thread: tritonclient's HTTP client is not thread-safe
            if getattr(local, "client", None) is None:
                local.client = RankerClient(args.url, args.protocol, dataset=spec, timeout=args.timeout,
                                            retry=Retry(attempts=args.retries + 1))
            if ids_of is not None:
                user = ids_of.key(dataset.Side.CONTEXT)
                return local.client.rank_ids(context[user] if user and context else None,
                                             candidates[ids_of.key(dataset.Side.CANDIDATE)].tolist(), k)
            return local.client.rank(context, candidates, k)
    try:
        summary = rank_files(args.input, args.output, spec, args.group_by, rank, args.k,
                             concurrency=1 if args.local else args.concurrency)
    except (GroupError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    line = (f"ranked {summary.candidates} candidates in {summary.groups} groups in {summary.seconds:.1f}s "
            f"-> {args.output}")
    if summary.quality is not None:
        q = summary.quality
        line += f"; NDCG@{q.k} {q.ndcg:.4f}, MRR {q.mrr:.4f} over {q.groups} groups with a positive and a negative"
    print(line)
    return 0

def cmd_materialize(args) -> int:

    from ensemble import dataset, online
    from ensemble.online import materialize

    url = args.store or os.environ.get(online.ENV["url"])
    if not url:
        print("error: name the store: --store URL or ENSEMBLE_STORE_URL", file=sys.stderr)
        return 2
    try:
        spec = dataset.load_spec(args.dataset)
        if args.check:
            print(json.dumps(materialize.check(spec, url), indent=1))
            return 0
        if args.files:
            from ensemble.data import tables

            frame = tables.read_table(args.files, spec, with_label=False)
        elif spec.name == "movielens100k":
            from ensemble.data import movielens

            frame = movielens.load()
        else:
            print(f"error: give the {spec.name} data files to materialize", file=sys.stderr)
            return 2
        report = materialize.materialize(spec, frame, url)
    except (dataset.SpecError, materialize.MaterializeError, online.StoreError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for side in report.sides:
        print(f"{side.side} ({side.key}): {side.entities} entities, {side.written} written, {side.unchanged} "
              f"unchanged, {side.kept_newer} kept (the store's are newer)")
    print(f"{report.seconds:.2f} s; store memory {report.memory_before / 2**20:.1f} -> "
          f"{report.memory_after / 2**20:.1f} MiB ({report.store})")
    if args.report:
        Path(args.report).write_text(json.dumps(report.as_dict(), indent=1) + "\n")
    return 0

def cmd_score(args) -> int:
    from clients.batch.input import BadInput
    from clients.batch.score import ChunkFailed, ScoreSettings
    from clients.batch import score_files, score_files_dask
    from clients.triton import Retry

    if not args.local and not args.url:
        print("error: give --url (one or more) or --local", file=sys.stderr)
        return 2
    if args.local and args.url:
        print("error: --local scores in this process; it does not use --url (give one of the two)", file=sys.stderr)
        return 2
    suffix = Path(args.output).suffix.lower()
    if not (args.dask_scheduler or args.dask_local) and suffix not in (".parquet", ".pq", ".csv"):
        print(f"error: --output {args.output}: the output is Parquet (.parquet) or CSV (.csv), not {suffix or 'no suffix'}",
              file=sys.stderr)
        return 2
    from ensemble import dataset

    settings = ScoreSettings(urls=tuple(args.url or ()), protocol=args.protocol, local=args.local,
                             repository=args.repository, batch_size=args.batch_size,
                             concurrency=args.concurrency, all_scores=args.all_scores,
                             retry=Retry(attempts=args.retries + 1, backoff=args.backoff), timeout=args.timeout,
                             skip_bad_lines=args.skip_bad_lines, dataset=dataset.load_spec(args.dataset))
    partition_bytes = int(args.partition_mb * 2**20)
    try:
        if args.dask_scheduler or args.dask_local:
            summary = score_files_dask(args.input, args.output, settings, args.dask_scheduler, args.dask_local,
                                       progress=not args.no_progress, partition_bytes=partition_bytes)
        else:
            summary = score_files(args.input, args.output, settings, progress=not args.no_progress,
                                  partition_bytes=partition_bytes)
    except BadInput as exc:
        print(f"error: {exc}" + ("" if exc.line is None else " (--skip-bad-lines skips and counts such lines)")
              + f"\nno output written to {args.output}", file=sys.stderr)
        return 1
    except ChunkFailed as exc:
        print(f"error: {exc}\nno output written to {args.output}", file=sys.stderr)
        return 1
    print(summary.line())
    return 0


def add_commands(sub) -> None:
    """This group's subcommands, in the order `ensemble --help` lists them."""
    p = _command(sub, "score", "score files (TSV/.gz/Parquet) through Triton, in-process, or on Dask")
    p.add_argument("input", nargs="+",
                   help="Criteo TSV (.gz too; label optional) or Parquet files; with --dataset: CSV/TSV files with a "
                        "header row, or Parquet")
    p.add_argument("--dataset", default="criteo",
                   help="the inputs' spec: a built-in name or a spec file (docs/your-data.md)")
    p.add_argument("--output", required=True, help="Parquet, or CSV by suffix; a folder with --dask-*")
    p.add_argument("--url", action="append", help="Triton endpoint host:port or http://, grpc:// (repeatable)")
    p.add_argument("--protocol", choices=["http", "grpc"], default="http",
                   help="for --url values without a scheme")
    p.add_argument("--local", action="store_true", help="score in-process from --repository, no server")
    p.add_argument("--repository", default="model_repository", help="what --local loads")
    p.add_argument("--batch-size", type=int, default=4096, help="rows per request")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight per process")
    p.add_argument("--all-scores", action="store_true", help="also write score_xgb, score_dlrm_torch, score_dlrm_tf")
    p.add_argument("--retries", type=int, default=5, help="retries of a request after a transient failure")
    p.add_argument("--backoff", type=float, default=0.5, help="first retry pause in seconds (doubles, max 4)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--dask-scheduler", default=None, help="address of a running Dask scheduler")
    p.add_argument("--dask-local", type=int, default=0, help="start a LocalCluster with N worker processes")
    p.add_argument("--partition-mb", type=float, default=64, help="plain-TSV partition size")
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="skip malformed TSV lines and count them in the summary (default: stop at the first, "
                        "naming file and line)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_score)

    p = _command(sub, "rank", "rank a file of groups (one context and its candidate rows each) through Triton")
    p.add_argument("input", nargs="+", help="CSV/TSV files with a header row, or Parquet, with the spec's columns")
    p.add_argument("--group-by", required=True, help="the column naming each group (a user, a query, a session)")
    p.add_argument("--dataset", default="criteo", help="the data's spec: a built-in name or a spec file")
    p.add_argument("--output", required=True, help="Parquet, or CSV by suffix: group, row, score, rank")
    p.add_argument("--k", type=int, default=None, help="keep each group's best k candidates (default: all)")
    p.add_argument("--url", default=None, help="Triton endpoint host:port or http://, grpc://")
    p.add_argument("--protocol", choices=["http", "grpc"], default=None,
                   help="for a --url without a scheme (default http)")
    p.add_argument("--ids", action="store_true",
                   help="the files hold the spec's keys only (user and item ids): the server reads their features "
                        "from its online store (ensemble serve --store; items it does not hold are left out)")
    p.add_argument("--local", action="store_true", help="rank in-process from --repository, no server")
    p.add_argument("--repository", default="model_repository", help="what --local loads")
    p.add_argument("--concurrency", type=int, default=4, help="ranking requests in flight")
    p.add_argument("--retries", type=int, default=3, help="retries of a request after a transient failure")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    p.set_defaults(func=cmd_rank)

    p = _command(sub, "materialize", "write each entity's latest features into the online store (ranking by ids)")
    p.add_argument("files", nargs="*", help="CSV/TSV/Parquet files with the spec's columns (the built-in MovieLens "
                                            "100k needs none)")
    p.add_argument("--dataset", required=True, help="the data's spec: a built-in name or a spec file (with keys)")
    p.add_argument("--store", default=None, metavar="URL",
                   help="redis://[user:password@]host:port/db or rediss://... (default: ENSEMBLE_STORE_URL)")
    p.add_argument("--check", action="store_true", help="report what the store holds and how stale, write nothing")
    p.add_argument("--report", default=None, help="also write the report as JSON here")
    p.set_defaults(func=cmd_materialize)
