"""`ensemble` command line: subcommands in pipeline order, each a thin wrapper."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from pathlib import Path

from ensemble.models.registry import Layout
from ensemble.models.slipstream import SlipstreamConfig
from ensemble.operate import monitoring
from ensemble.repository.configs import DEFAULT_OBJECTIVE_MS
from ensemble.operate.server import DEFAULT_LAYOUT

# `ensemble.data.criteo` imports pandas (~0.4 s): imported inside the commands that use it, so that
# `--help` and argument errors answer at once.


class _Help(argparse.HelpFormatter):
    """An option's help line ends with its default, where it has one worth showing."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        if "%(default)" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        if isinstance(action.default, (list, tuple)):  # as it would be typed: values separated by spaces
            return f"{text} (default: {' '.join(map(str, action.default))})".replace("%", "%%")
        return f"{text} (default: %(default)s)"


def _command(sub, name: str, text: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=text, description=text, formatter_class=_Help)


def _synth_config(args):
    from ensemble.data import criteo

    return criteo.SynthConfig(rows=args.rows, scale=args.scale, seed=args.seed)


def _train_config(args):
    from ensemble import training
    from ensemble.models.dlrm import DLRMConfig
    from ensemble.models.xgb import XGBConfig
    from ensemble.device import resolve_device
    from ensemble.models.xgb import XGBMatrix
    from ensemble.training import TrainConfig

    from ensemble import dataset
    from ensemble import model_size as sizes

    extra = {"xgb_matrix": XGBMatrix(args.xgb_matrix)} if getattr(args, "xgb_matrix", None) else {}
    spec = dataset.load_spec(getattr(args, "dataset", None) or dataset.DEFAULT)
    size = sizes.resolve(args.model_size, dict(spec.model), {
        "embedding_dim": args.embedding_dim, "bottom_mlp": args.bottom_mlp, "top_mlp": args.top_mlp,
        "xgb_rounds": args.xgb_rounds, "xgb_depth": args.xgb_depth})
    spec = dataset.with_table_shape(spec, getattr(args, "table_shape", None))
    row_store = {"auto": None, "on": True, "off": False}[getattr(args, "row_store", "auto") or "auto"]
    return training.TrainConfig(
        spec=spec, row_store=row_store, table_budget_gib=getattr(args, "table_budget_gib", 8.0),
        init_from=Path(args.init_from) if getattr(args, "init_from", None) else None,
        freq_threshold=args.freq_threshold,
        xgb=XGBConfig(rounds=size.xgb_rounds, max_depth=size.xgb_depth),
        dlrm=DLRMConfig(epochs=args.epochs or DLRMConfig().epochs, embedding_dim=size.embedding_dim,
                        bottom_mlp=size.bottom_mlp, top_mlp=size.top_mlp),
        device=resolve_device(args.device),
        # Stages (the GPU deployment trains torch and TensorFlow models in separate images).
        models=tuple(args.models.split(",")) if getattr(args, "models", None) else TrainConfig().models,
        reuse_features=getattr(args, "reuse_features", False),
        slipstream=_slipstream_config(args),
        **extra,
    )


def _slipstream_config(args) -> SlipstreamConfig | None:
    """`--slipstream` and its settings (only the train command has them)."""
    if not getattr(args, "slipstream", False):
        return None
    return SlipstreamConfig(hot_share=args.slip_hot_share, drop_share=args.slip_drop_share, alpha=args.slip_alpha,
                            window=args.slip_window, warmup_steps=args.slip_warmup_steps)


def _add_slipstream(p: argparse.ArgumentParser) -> None:
    defaults = SlipstreamConfig()
    p.add_argument("--slipstream", action="store_true",
                   help="train dlrm_torch with Slipstream: skip inputs whose hot embeddings went stale "
                        "(docs/training.md; dlrm_tf trains as usual)")
    p.add_argument("--slip-hot-share", type=float, default=defaults.hot_share,
                   help="Λ: a table row is hot when this share of training inputs looks it up")
    p.add_argument("--slip-drop-share", type=float, default=defaults.drop_share,
                   help="D: target share of inputs skipped once skipping starts")
    p.add_argument("--slip-alpha", type=float, default=defaults.alpha,
                   help="α: skip an input when this share of its 26 lookups are stale")
    p.add_argument("--slip-window", type=int, default=defaults.window,
                   help="optimizer steps between embedding snapshots (staleness = change over one window)")
    p.add_argument("--slip-warmup-steps", type=int, default=defaults.warmup_steps,
                   help="steps trained on every input before the first snapshot")


def _latency_summaries(args):
    """Off unless asked for: ``--latency-summaries``, or quantiles given without ``--no-latency-summaries``."""
    enabled = args.latency_summaries if args.latency_summaries is not None else args.latency_quantiles is not None
    return monitoring.LatencySummaries(enabled, args.latency_quantiles or monitoring.DEFAULT_QUANTILES)


def _server_options(args):
    from ensemble.operate.server import ServerOptions

    from ensemble.operate.control import ADMIN_KEY_ENV

    from ensemble.operate.allocator import Allocator

    return ServerOptions(Path(args.repository), host=args.host, http_port=args.http_port,
                         grpc_port=args.grpc_port, metrics_port=args.metrics_port,
                         layout=Layout(args.layout),
                         log_file=Path(args.log_file) if args.log_file else None,
                         admin_key=os.environ.get(ADMIN_KEY_ENV) or None,
                         latency_summaries=_latency_summaries(args),
                         latency_objective_ms=args.latency_objective_ms, allocator=Allocator(args.allocator),
                         require_declared=getattr(args, "require_declared", False), store=_store(args),
                         tables=_tables_settings(args))


def _tables_settings(args) -> dict[str, str]:
    """A row store's serving settings, as the environment the DLRM steps read them from
    (:mod:`ensemble.tables.serving`)."""
    from ensemble.tables import serving

    found = {serving.CACHE_ENV: f"{getattr(args, 'embedding_cache_gib', serving.DEFAULT_CACHE_GIB):g}"}
    for env, value in ((serving.IO_ENV, getattr(args, "table_io", None)),
                       (serving.ADMISSION_ENV, getattr(args, "table_admission", None)),
                       (serving.READ_TIMEOUT_ENV, getattr(args, "table_read_timeout_ms", None)),
                       (serving.COLD_ENV, getattr(args, "table_cold", None)),
                       (serving.REDIS_PREFIX_ENV, getattr(args, "table_redis_prefix", None))):
        if value is not None:
            found[env] = f"{value:g}" if isinstance(value, float) else str(value)
    return found


def _store(args):
    """The online store's settings: ``--store URL`` or, to keep a password off the command line, the
    ENSEMBLE_STORE_URL environment variable (a Kubernetes Secret sets it)."""
    from ensemble import online

    url = getattr(args, "store", None) or os.environ.get(online.ENV["url"])
    if not url:
        return None
    try:
        given = {field: getattr(args, name) for field, name in (
            ("timeout_ms", "store_timeout_ms"), ("cache_entries", "store_cache_entries"), ("ttl_s", "store_cache_ttl_s"),
            ("unknown_items", "unknown_items"), ("max_staleness_s", "max_staleness_s"), ("stale", "stale"))
            if getattr(args, name, None) is not None}
        return online.StoreSettings(url, **given)
    except ValueError as exc:
        raise SystemExit(f"ensemble serve: {exc}") from None


def cmd_synth(args) -> int:
    from ensemble.data import criteo

    summary = criteo.write_synthetic(_synth_config(args), args.output)
    print(f"wrote {summary.rows} rows to {summary.path}; click rate {summary.click_rate:.3f}; "
          f"best possible AUC (the generator's own probabilities) {summary.best_auc:.4f}")
    return 0


def cmd_train(args) -> int:
    from ensemble import training
    from ensemble.models.distributed import dask_client

    if args.dask_scheduler and args.dask_local:
        print("error: give --dask-scheduler or --dask-local, not both", file=sys.stderr)
        return 2
    if args.slipstream and (args.dask_scheduler or args.dask_local):
        print("error: --slipstream trains in one process; it does not combine with a Dask cluster", file=sys.stderr)
        return 2
    from dataclasses import replace

    from ensemble import dataset

    spec = dataset.load_spec(args.dataset)
    if spec.name != dataset.DEFAULT:  # a dataset of its own: files with a header, in memory
        if args.dask_scheduler or args.dask_local or args.slipstream:
            print(f"error: {spec.name}: --dask-* and --slipstream train Criteo files only", file=sys.stderr)
            return 2
        from ensemble.data import tables

        frame = tables.read_table(args.input, spec, nrows=args.nrows)
        train, valid, test = tables.split(frame, args.valid_fraction, args.test_fraction, time=spec.time)
        report = training.train_all(train, valid, test, args.workdir, replace(_train_config(args), spec=spec))
        print(json.dumps(report.get("test", report), indent=1))
        return 0
    with dask_client(args.dask_scheduler, args.dask_local) as client:
        report = training.train_files(args.input, args.workdir, _train_config(args), nrows=args.nrows,
                                      valid=args.valid_fraction, test=args.test_fraction, client=client)
    print(json.dumps(report.get("test", report), indent=1))
    return 0


def cmd_export(args) -> int:
    from ensemble.operate.records import loaded_versions
    from ensemble.repository.export import TrainedArtifacts, export_repository

    workdir = Path(args.workdir)
    written = export_repository(TrainedArtifacts.under(workdir), args.repository, keep=args.keep,
                                loaded=loaded_versions(args.repository), log=print)
    for model, folder in written.items():
        print(f"{model.value:<11} {folder}")
    return 0


def cmd_serve(args) -> int:
    options = _server_options(args)
    if args.replicas != 1 or not options.loopback:  # an exposed server is a fleet of one behind the door
        return _serve_fleet(args)
    if args.replica_ports is not None or args.gateway_admin_port is not None:
        print("error: --replica-ports and --gateway-admin-port apply to a gateway (--replicas 2 or more, or a "
              "--host other than loopback)", file=sys.stderr)
        return 2
    from ensemble.operate import allocator
    from ensemble.operate.server import ServerError, TritonServer
    from ensemble.operate.lifecycle import run_until_signal
    from ensemble.operate.supervise import Supervisor

    server = TritonServer(options)
    try:
        supervisor = Supervisor(server, log=lambda line: print(line, flush=True))

        def supervise(stopped) -> None:
            server.start()
            print(f"ready: HTTP http://{server.http_url}  gRPC grpc://{server.grpc_url}  metrics {server.metrics_url}")
            preloaded = allocator.library(server.options.allocator) or "the system's"
            print(f"log: {server.log_file}; allocator: {preloaded}", flush=True)
            _print_engines(options.repository)
            _print_c_modules()
            supervisor.run(stopped)

        run_until_signal(on_tick=supervise)
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        server.stop()
        return 1
    server.stop()
    print("stopped")
    return 0


def _print_c_modules() -> None:
    """A line per C module this install lacks, and what serves in its place (the backend's
    ensemble_c_module_built metric says the same to Prometheus)."""
    from ensemble.native.built import missing_lines

    for line in missing_lines():
        print(f"warning: {line}", file=sys.stderr, flush=True)


def _print_engines(repository: Path) -> None:
    """Which engine scores each DLRM step of the newest release, as the release declares it (the server's
    log says what each replica loaded: ensemble.models.engines)."""
    from ensemble.models import engines
    from ensemble.scoring.pipeline import release_versions

    try:
        lines = engines.describe(release_versions(repository))
    except (FileNotFoundError, KeyError, ValueError) as exc:
        lines = [f"engines: not read ({exc})"]
    for line in lines:
        print(f"engine {line}", flush=True)


def cmd_engines(args) -> int:
    from ensemble.models import engines, registry
    from ensemble.scoring.pipeline import release_versions

    folders = release_versions(Path(args.repository), args.release)
    for choice in args.declare or ():
        step, _, name = choice.partition("=")
        try:
            engines.set_engine(folders, step, name)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.measure:
        with engines.held_out(Path(args.workdir) / engines.HELD_OUT_DIR if args.workdir else None):
            records = registry.redeclare(folders, args.budget)
        for record in records:
            print(f"{record['step']}: measured on {record['machine']['model']}: "
                  + "; ".join(f"{e} " + " ".join(f"{r}:{t:g}" for r, t in times.items())
                              for e, times in record.get("us_per_row", {}).items()) + " (us per row at rows:)")
    for line in engines.describe(folders):
        print(line)
    return 0


def _serve_fleet(args) -> int:
    """``ensemble serve --replicas N``: N supervised tritonservers behind the Envoy gateway (docs/fleet.md);
    with one, the door of a server bound elsewhere than loopback (docs/reliability.md)."""
    from ensemble.fleet.fleet import Fleet, FleetOptions
    from ensemble.operate.lifecycle import run_until_signal
    from ensemble.operate.server import ServerError

    try:
        fleet = Fleet(FleetOptions(_server_options(args), args.replicas, replica_ports=args.replica_ports,
                                   admin_port=args.gateway_admin_port), log=lambda line: print(line, flush=True))
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    def supervise(stopped) -> None:
        fleet.start()
        print("\n".join(fleet.describe()), flush=True)
        _print_engines(Path(args.repository))
        _print_c_modules()
        fleet.run(stopped)

    try:
        run_until_signal(on_tick=supervise)
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:  # drains the gateway, then stops the replicas (whatever ended the run)
        fleet.stop()
    print("stopped")
    return 0


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
    import json

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
    from clients.partitions import BadInput, ChunkFailed, ScoreSettings
    from clients.scoring import score_files, score_files_dask
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


def cmd_declare(args) -> int:
    from ensemble.repository import declared
    from ensemble.operate.deploy import available_releases

    if args.clear:
        declared.path(args.repository).unlink(missing_ok=True)
    elif args.release is not None:
        if args.release not in available_releases(args.repository):
            print(f"error: no release {args.release} in {declared.path(args.repository).parent} "
                  f"(it has {available_releases(args.repository) or 'none'})", file=sys.stderr)
            return 2
        declared.write(args.repository, args.release, "ensemble declare")
    release = declared.read(args.repository)
    print(f"declared: release {release}" if release is not None else
          "declared: none (a server started on this repository loads its newest release)")
    return 0


def cmd_tables(args) -> int:
    """Each row store DLRM's tables in a release: rows, format, bytes on disk, where they are served from,
    delta rows, and the hit rate training's counts predict for the hot tier's budget."""
    from ensemble.repository import declared
    from ensemble.operate.deploy import available_releases
    from ensemble.scoring.pipeline import release_versions
    from ensemble.tables import files
    from ensemble.tables.serving import big_rows, budget_share

    releases = available_releases(args.repository)
    release = args.release if args.release is not None else (declared.read(args.repository) or
                                                             (releases[-1] if releases else None))
    if release is None:
        print(f"error: no release in {args.repository}", file=sys.stderr)
        return 2
    folders = {m.value: f for m, f in release_versions(args.repository, release).items() if files.has_tables(f)}
    if not folders:
        print(f"release {release}: no DLRM keeps its tables in a row store (they are in the models)")
        return 0
    if args.to_redis:  # a fleet's cold tier: the large tables' blocks into Redis
        from ensemble.online import connect

        client = connect(args.to_redis, timeout_s=30.0)
        total = sum(files.to_redis(client, folder, step, args.redis_prefix) for step, folder in folders.items())
        print(f"release {release}: {total / 1e9:.2f} GB written into {args.to_redis.split('@')[-1]} "
              f"(prefix {args.redis_prefix})")
        return 0
    budget = int(args.budget_gib * 2**30)
    manifests = {step: files.TablesManifest.load(f) for step, f in folders.items()}
    rows_by_step = {step: big_rows(m) for step, m in manifests.items()}
    for step, folder in folders.items():
        manifest = manifests[step]
        share = budget_share(step, manifest, rows_by_step)
        predicted = files.predicted_hit_rates(folder, int(budget * share))
        print(f"{step} (release {release}, version {folder.name}): {len(manifest.tables)} tables in {manifest.format}, "
              f"{manifest.disk_bytes() / 1e9:.2f} GB on disk; hot tier {budget * share / 2**30:.2f} GiB of "
              f"{args.budget_gib:g}; predicted hit rate {predicted['overall']:.1%} (training's counts)")
        print(f"  {'table':<8} {'rows':>12} {'format':<6} {'on disk':>10} {'served from':<12} {'delta rows':>10} "
              f"{'predicted hits':>14}")
        for t in manifest.tables:
            where = "RAM" if t.small else "hot tier+disk"
            shared = f" (shared with {t.shared_from})" if t.shared_from else ""
            print(f"  {t.name:<8} {t.rows:>12,} {manifest.format:<6} {t.bytes / 1e9:>8.3f}GB {where:<12} "
                  f"{t.delta.rows if t.delta else 0:>10,} {predicted[t.name]:>14.1%}{shared}")
    return 0


def cmd_deploy(args) -> int:
    from ensemble.fleet import release as fleet_release
    from ensemble.operate.control import ControlError
    from ensemble.operate.deploy import deploy, rollback

    fleet = fleet_release.find(args.url)
    if fleet is not None:  # a gateway: release across every replica behind it
        try:
            if args.command == "deploy":
                release = fleet_release.deploy(fleet, args.release, args.holdout)
            else:
                release = fleet_release.rollback(fleet)
        except ControlError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"serving release {release} on {len(fleet.gateway.replicas)} replicas behind the gateway at {args.url}")
        return 0
    grpc_url = args.grpc_url or f"{args.url.split('://', 1)[-1].rsplit(':', 1)[0]}:8001"
    try:
        if args.command == "deploy":
            release = deploy(args.url, args.repository, args.release, args.holdout, grpc_url=grpc_url)
        else:
            release = rollback(args.url, args.repository, grpc_url=grpc_url)
    except ControlError as exc:  # a refused release (DeployError) or a server that said no
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"serving release {release} at {args.url}")
    return 0


def cmd_experiment(args) -> int:
    from ensemble.fleet import experiment
    from ensemble.fleet import release as fleet_release
    from ensemble.operate.control import ControlError

    fleet = fleet_release.find(args.url)
    if fleet is None:
        print(f"error: no gateway recorded at {args.url}: experiments run behind a gateway (`ensemble serve "
              "--replicas N`, or one server exposed with --host); give its HTTP address", file=sys.stderr)
        return 1
    try:
        if args.action == "start":
            shares = args.share or []
            if len(shares) != len(args.candidate):
                print("error: give one --share per --candidate", file=sys.stderr)
                return 1
            experiment.start(fleet, list(zip(args.candidate, shares)), args.key, args.holdout, shadow=args.shadow)
        elif args.action == "promote":
            print(f"release {experiment.promote(fleet, args.candidate[0] if args.candidate else None)} serves every "
                  "request")
        elif args.action == "abort":
            print(f"experiment aborted: release {experiment.abort(fleet)} serves every request")
        else:
            running, arms = experiment.status(fleet)
            if running is None:
                print(f"no experiment: release {fleet.release} serves every request")
                return 0
            print(f"experiment since {running.started}, arms chosen by "
                  + (f"the '{running.key}' header or parameter" if running.key else "request")
                  + (f", {running.shadow:g}% of the serving release's requests shadowed" if running.shadow else ""))
            print("| release | share | answered | refused or failed | mean ms |\n| --- | --- | --- | --- | --- |")
            for arm in arms:
                role = " (serving)" if arm.release == fleet.release else ""
                print(f"| {arm.release}{role} | {arm.share:g}% | {arm.requests} | {arm.failures} | {arm.mean_ms:.3f} |")
    except ControlError as exc:  # a refused experiment (DeployError) or a replica that said no
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_baseline_serve(args) -> int:
    from loadtest.baselines.app import Kind, serve

    print(f"baseline {args.kind} on http://{args.host}:{args.port} (repository {args.repository})", flush=True)
    serve(Kind(args.kind), args.repository, args.host, args.port, args.threads)
    return 0


def cmd_loadtest(args) -> int:
    from loadtest.runner import RunnerOptions, run

    options = RunnerOptions.from_args(args)
    report = run(options)
    print(f"report: {report}")
    return 0


def cmd_cost(args) -> int:
    from loadtest.cost import cost_table, load_prices, render

    results = json.loads(Path(args.results).read_text())
    print(render(cost_table(results, load_prices(args.prices))))
    return 0


def cmd_demo(args) -> int:
    from dataclasses import replace

    from ensemble.demo import DemoOptions, run_demo

    options = DemoOptions(synth=_synth_config(args), train=_train_config(args), workdir=Path(args.workdir),
                          repository=Path(args.repository), server=_server_options(args),
                          keep_serving=args.keep_serving)
    if args.dataset == "movielens100k":
        from ensemble.demo_movielens import DLRM_EPOCHS, run_movielens_demo

        if args.epochs is None:
            options = replace(options, train=replace(options.train, dlrm=replace(options.train.dlrm, epochs=DLRM_EPOCHS)))
        run_movielens_demo(options)
        return 0
    run_demo(options)
    return 0


def cmd_check(args) -> int:
    from ensemble.check.compat import CheckOptions, report, run_check
    from ensemble.models.triton_releases import RELEASES

    release = RELEASES[args.release]
    findings = run_check(CheckOptions(Path(args.repository), args.target, release,
                                      Path(args.treelite_dir) if args.treelite_dir else None,
                                      args.tensorflow_python))
    print(report(findings, release, args.target))
    return 0 if all(f.ok for f in findings) else 1


def _add_synth(p: argparse.ArgumentParser, rows: int) -> None:
    p.add_argument("--rows", type=int, default=rows, help="rows to generate")
    p.add_argument("--scale", type=float, default=0.01,
                   help="category cardinalities as a fraction of Criteo's (1.0 = millions of values)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the generator")


def _widths(text: str) -> tuple[int, ...]:
    from ensemble.model_size import SizeError, widths

    try:
        return widths(text)
    except SizeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", default="build", help="training artifacts and reports")
    p.add_argument("--freq-threshold", type=int, default=None,
                   help="Categorify frequency threshold for every categorical column (default: the dataset spec's; Criteo 3)")
    p.add_argument("--model-size", choices=["demo", "seed"], default=None,
                   help="demo: 16-wide embeddings, 64-32 / 128-64 MLPs, up to 400 trees of depth 8; seed: the DLRM "
                        "reference's Criteo size (128, 512-256-128 / 1024-1024-512-256-1) and up to 1,000 trees "
                        "(default: the dataset spec's [model] size, else demo; the options below change it)")
    p.add_argument("--xgb-rounds", type=int, default=None, help="most boosting rounds (early stopping)")
    p.add_argument("--xgb-depth", type=int, default=None, help="the trees' maximum depth")
    p.add_argument("--epochs", type=int, default=None,
                   help="most DLRM epochs; the best on validation is kept (default 2; the movielens100k demo: 4)")
    p.add_argument("--embedding-dim", type=int, default=None, help="DLRM embedding width (the bottom MLP's output)")
    p.add_argument("--bottom-mlp", type=_widths, default=None, metavar="W,W,...",
                   help="the DLRMs' bottom MLP hidden widths, e.g. 512,256")
    p.add_argument("--top-mlp", type=_widths, default=None, metavar="W,W,...",
                   help="the DLRMs' top MLP hidden widths, e.g. 1024,1024,512,256")
    p.add_argument("--device", choices=["auto", "cpu", "gpu"], default="cpu",
                   help="gpu: mixed precision and GPU trees (written for GPUs, not run on this project's machines)")
    p.add_argument("--table-shape", choices=sorted(dataset_shapes()), default=None,
                   help="hash every categorical column into a built-in shape's rows: criteo-1tb is the DLRM seed's "
                        "Criteo Terabyte model (ids capped at 40M: 204,184,588 rows per DLRM)")
    p.add_argument("--row-store", choices=["auto", "on", "off"], default="auto",
                   help="keep the DLRMs' tables out of memory (docs/tables.md): a step "
                        "reads and updates its batch's rows only, the export writes every row to disk; auto: when "
                        "a table has 1,000,000 rows or more")
    p.add_argument("--table-budget-gib", type=float, default=8.0, metavar="GIB",
                   help="with a row store: memory the rows training touched may take, then a file of the work folder")
    p.add_argument("--init-from", default=None, metavar="REPOSITORY",
                   help="with a row store: the rows a step touches first start from this repository's serving "
                        "release (declared, else newest) instead of their initialization; its next export shares "
                        "the unchanged table files with that release")


def dataset_shapes() -> tuple[str, ...]:
    from ensemble.dataset import TABLE_SHAPES

    return tuple(TABLE_SHAPES)


def _quantiles(text: str) -> tuple[tuple[float, float], ...]:
    try:
        return monitoring.parse_quantiles(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_server(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repository", default="model_repository", help="the Triton model repository")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (another than loopback needs ENSEMBLE_ADMIN_KEY and puts tritonserver on loopback "
                        "behind the Envoy gateway: docs/reliability.md, \"The door\")")
    p.add_argument("--http-port", type=int, default=8000, help="HTTP/REST port (v2 protocol)")
    p.add_argument("--grpc-port", type=int, default=8001, help="gRPC port")
    p.add_argument("--metrics-port", type=int, default=8002, help="Prometheus metrics port")
    p.add_argument("--layout", choices=[layout.value for layout in Layout], default=DEFAULT_LAYOUT.value,
                   help="native: the ranker inside Triton's process through the project's backend (the CPU "
                        "default); fused: the ranker as one python-backend model (the fallback); ensemble: a "
                        "Triton ensemble of one python-backend model per step; gpu: the NGC container's "
                        "native backends")
    p.add_argument("--log-file", default=None, help="server log (default: a temp file)")
    p.add_argument("--latency-objective-ms", type=float, default=None, metavar="MS",
                   help="the ranker (native and fused layouts) refuses (503 / UNAVAILABLE) only a request it "
                        "predicts would complete later than this after it arrived, or than its client's timeout "
                        "if sooner "
                        f"(default: the repository config's, {DEFAULT_OBJECTIVE_MS:g} ms as exported)")
    p.add_argument("--latency-summaries", action=argparse.BooleanOptionalAction, default=None,
                   help="export Triton's latency summaries (*_summary_us quantiles, the dashboard's latency "
                        "panels) on the metrics port; off by default, as in Triton: on a busy core their upkeep "
                        "costs more than a 1-row request's own work (the cumulative counters are always on)")
    p.add_argument("--latency-quantiles", type=_quantiles, metavar="Q:ERR,...", default=None,
                   help="quantiles (with allowed rank error) of the latency summaries; implies "
                        "--latency-summaries (default: "
                        f"{monitoring.format_quantiles(monitoring.DEFAULT_QUANTILES)})")
    p.add_argument("--require-declared", action="store_true",
                   help="refuse to start when a DLRM step's declared engine (the release's engine.json) cannot "
                        "run on this machine, instead of scoring with the C pass or the framework (logged)")
    p.add_argument("--store", default=None, metavar="URL",
                   help="the online feature store of ranking requests by ids (redis://[user:password@]host:port/db, "
                        "rediss://...; a Redis Cluster node works too); default: ENSEMBLE_STORE_URL (docs/your-data.md, "
                        "\"Ranking by ids\")")
    p.add_argument("--store-timeout-ms", type=float, default=50.0, metavar="MS",
                   help="the longest a store round trip may take: past it the request is refused (503 / UNAVAILABLE "
                        "naming the store); keep it below the latency objective (default: 50.0)")
    p.add_argument("--store-cache-entries", type=int, default=100_000, metavar="N",
                   help="entities the rank model keeps in memory (0: every lookup asks the store) (default: 100000)")
    p.add_argument("--store-cache-ttl-s", type=float, default=60.0, metavar="S",
                   help="how long a cached entity is served before the store is asked again (default: 60.0)")
    p.add_argument("--unknown-items", choices=["drop", "default"], default="drop",
                   help="an item id the store does not hold: dropped from the ranking (its index answered in "
                        "'dropped'), or scored with missing features (default: drop)")
    p.add_argument("--max-staleness-s", type=float, default=None, metavar="S",
                   help="an entity whose features are older than this (by the spec's time column) is stale "
                        "(default: no bound)")
    p.add_argument("--stale", choices=["serve", "refuse"], default="serve",
                   help="what happens to a request naming a stale entity: served (and counted) or refused (503) "
                        "(default: serve)")
    p.add_argument("--allocator", choices=["auto", "tcmalloc", "system"], default="auto",
                   help="tritonserver's memory allocator: auto preloads tcmalloc when installed (Debian: "
                        "libtcmalloc-minimal4), else runs on the system's")
    p.add_argument("--embedding-cache-gib", type=float, default=6.0, metavar="GIB",
                   help="a row store release (tables larger than memory): the hot tier's RAM for every large table "
                        "of both DLRMs (docs/tables.md)")
    p.add_argument("--table-io", choices=["uring", "pread", "mmap"], default=None,
                   help="how cold rows are read: io_uring with a bounded queue depth (the default where built), one "
                        "pread at a time, or a shared mapping (the page cache's way)")
    p.add_argument("--table-admission", choices=["always", "second", "none"], default=None,
                   help="which missed rows enter the hot tier: every one (the default, chosen by measurement: "
                        "docs/tables.md), one missed twice within the doorkeeper's window, or none (only what the "
                        "warm file put there)")
    p.add_argument("--table-cold", default=None, metavar="URL",
                   help="read the large tables' cold rows from Redis instead of the local disk: "
                        "redis://host:port[,host:port...] (a cluster's nodes, or one node), filled by ensemble tables "
                        "--to-redis; the release's small files stay local")
    p.add_argument("--table-redis-prefix", default=None, help="the cold tier's key prefix (default: ensemble-tables)")
    p.add_argument("--table-read-timeout-ms", type=float, default=None, metavar="MS",
                   help="the longest a request's cold reads may take: past it the request is refused (503 / "
                        "UNAVAILABLE naming the table) (default: 1000)")


def _replica_count(text: str) -> int:
    from ensemble.fleet.fleet import MAX_REPLICAS

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 1 <= value <= MAX_REPLICAS:
        raise argparse.ArgumentTypeError(f"must be 1 to {MAX_REPLICAS}, got {value}")
    return value


def _add_fleet(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=_replica_count, default=1,
                   help="tritonservers to run; 2 or more run behind an Envoy gateway on --http-port and --grpc-port, "
                        "replica i serving metrics on --metrics-port + i (docs/fleet.md); one server on a --host "
                        "other than loopback runs behind the gateway too (docs/reliability.md, \"The door\")")
    p.add_argument("--replica-ports", type=int, default=None, metavar="PORT",
                   help="with a gateway: replica i's HTTP port is PORT + 2i and its gRPC port PORT + 2i + 1, on "
                        "127.0.0.1 (default: free ports, printed at start)")
    p.add_argument("--gateway-admin-port", type=int, default=None, metavar="PORT",
                   help="with a gateway: its admin port on 127.0.0.1 (default: a free port, printed at start)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ensemble", description="Criteo ranking ensemble on Triton",
                                     formatter_class=_Help)
    sub = parser.add_subparsers(dest="command", required=True)

    p = _command(sub, "synth", "write a synthetic Criteo-format TSV")
    _add_synth(p, 300_000)
    p.add_argument("--output", default="build/data/synthetic.tsv", help=".gz suffix compresses")
    p.set_defaults(func=cmd_synth)

    p = _command(sub, "train", "fit features and train xgb, dlrm_torch, dlrm_tf and the blend")
    p.add_argument("input", nargs="+",
                   help="Criteo TSV day files (.gz too), in time order; with --dataset: CSV/TSV files with a header "
                        "row, or Parquet")
    p.add_argument("--dataset", default="criteo",
                   help="the data's spec: a built-in name (criteo, movielens100k) or a spec file (docs/your-data.md)")
    p.add_argument("--nrows", type=int, default=None, help="read at most this many rows (all when unset)")
    p.add_argument("--valid-fraction", type=float, default=0.1,
                   help="share of rows for validation (file order, or the spec's time column's)")
    p.add_argument("--test-fraction", type=float, default=0.1, help="share of rows held out for test (the last)")
    _add_train(p)
    p.add_argument("--models", default=None,
                   help="train only these (comma-separated: xgb,dlrm_torch,dlrm_tf); the blend is fitted once all "
                        "three have scores in --workdir")
    p.add_argument("--reuse-features", action="store_true",
                   help="reuse the workflow an earlier stage fitted in --workdir instead of fitting it again")
    p.add_argument("--xgb-matrix", choices=["quantile", "external"], default="quantile",
                   help="trees' training rows: quantile = bin indexes in memory (~40 B a row); external = "
                        "pages cached on disk (memory flat in rows, slower)")
    p.add_argument("--dask-scheduler", default=None, help="address of a running Dask scheduler to train on")
    p.add_argument("--dask-local", type=int, default=0, help="start a LocalCluster with N worker processes to train on")
    _add_slipstream(p)
    p.set_defaults(func=cmd_train)

    p = _command(sub, "export", "write a new version of every model into the repository")
    p.add_argument("--workdir", default="build", help="where `train` left the artifacts")
    p.add_argument("--repository", default="model_repository", help="the Triton model repository to write")
    p.add_argument("--keep", type=int, default=2,
                   help="versions to keep per model (2 keeps one to roll back to); the declared release, the versions "
                        "its declaration lists, an experiment's candidates, what a running server on the repository "
                        "has loaded, and their steps are kept as well (each named)")
    p.set_defaults(func=cmd_export)

    p = _command(sub, "tables", "a release's tables larger than memory: rows, format, bytes on disk, where they are "
                                "served from, delta rows, and the hit rate training's counts predict for a hot tier budget "
                                "(docs/tables.md)")
    p.add_argument("--repository", default="model_repository", help="the Triton model repository")
    p.add_argument("--release", type=int, default=None, help="the release (default: the declared one, else the newest)")
    p.add_argument("--budget-gib", type=float, default=6.0, metavar="GIB",
                   help="the hot tier's budget to predict for (ensemble serve --embedding-cache-gib)")
    p.add_argument("--to-redis", default=None, metavar="URL",
                   help="write the large tables' blocks into this Redis (a cluster's node, or one node): the cold tier "
                        "a fleet shares (ensemble serve --table-cold)")
    p.add_argument("--redis-prefix", default="ensemble-tables", help="the keys' prefix in Redis")
    p.set_defaults(func=cmd_tables)

    p = _command(sub, "serve", "run tritonserver on the repository until SIGINT/SIGTERM")
    _add_server(p)
    _add_fleet(p)
    p.set_defaults(func=cmd_serve)

    for name, text in (("deploy", "switch a running server (native or fused layout) to the newest exported release, "
                                  "after checks"),
                       ("rollback", "switch a running server (native or fused layout) back to the previous release")):
        p = _command(sub, name, text)
        p.add_argument("--url", default="127.0.0.1:8000",
                       help="the server's HTTP address (reads and checks), or the gateway's of a fleet started on this "
                            "machine by `ensemble serve --replicas N`: then every replica switches (docs/fleet.md)")
        p.add_argument("--grpc-url", default=None,
                       help="the server's gRPC address, which loads the release (default: --url's host, port 8001); "
                            "a load over HTTP would stall HTTP clients sharing Triton's thread for its whole length")
        p.add_argument("--repository", default="model_repository",
                       help="the repository that server serves (a fleet: the one it was started on)")
        if name == "deploy":
            p.add_argument("--release", type=int, default=None, help="a specific release (default: the newest)")
            p.add_argument("--holdout", default=None,
                           help="labelled Criteo TSV: compare the releases' AUC on it (default: the AUC each "
                                "release recorded at export)")
        p.set_defaults(func=cmd_deploy)

    p = _command(sub, "experiment", "candidates on live traffic behind a gateway: start, status, promote, abort "
                                    "(docs/fleet.md, Experiments)")
    p.add_argument("action", choices=["start", "status", "promote", "abort"])
    p.add_argument("--url", default="127.0.0.1:8000", help="the gateway's HTTP address")
    p.add_argument("--candidate", type=int, action="append", default=[],
                   help="start: a candidate release (repeatable, A/B/N); promote: the one to serve")
    p.add_argument("--share", type=float, action="append",
                   help="start: percent of requests for the candidate of the same position (repeatable)")
    p.add_argument("--key", default=None,
                   help="start: the request header, or else the request parameter, whose value keeps a "
                        "request's arm (such as a user id); default: each request's arm drawn at random")
    p.add_argument("--holdout", default=None, help="start: labelled Criteo TSV for the candidates' AUC check")
    p.add_argument("--shadow", type=float, default=0.0,
                   help="start: percent of the serving release's requests that every candidate scores too, after "
                        "the answer (native layout): score differences and top-k overlaps as histograms")
    p.set_defaults(func=cmd_experiment)

    p = _command(sub, "declare", "show or set the release every later server start on a repository loads")
    p.add_argument("--repository", default="model_repository", help="the Triton model repository")
    p.add_argument("--release", type=int, default=None,
                   help="declare this release (deploy and rollback declare the one they switch to); default: show")
    p.add_argument("--clear", action="store_true", help="remove the declaration: later starts load the newest release")
    p.set_defaults(func=cmd_declare)

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

    p = _command(sub, "baseline-serve", "a CPU baseline server (FastAPI) with the ranker's HTTP contract")
    p.add_argument("--kind", choices=["naive", "inproc"], required=True,
                   help="naive: pandas + NVTabular + the frameworks per request; inproc: the ensemble's own pipeline")
    p.add_argument("--repository", default="model_repository", help="the Triton model repository")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8010, help="HTTP port")
    p.add_argument("--threads", type=int, default=1, help="framework threads (same budget as the Triton models)")
    p.set_defaults(func=cmd_baseline_serve)

    p = _command(sub, "loadtest", "locust scenario matrix: Triton vs CPU baselines -> report folder")
    from loadtest.runner import add_arguments

    add_arguments(p)
    p.set_defaults(func=cmd_loadtest)

    p = _command(sub, "cost", "dollars per million predictions from a loadtest results.json")
    p.add_argument("results", help="results.json of a loadtest report")
    p.add_argument("--prices", default=str(Path(__file__).resolve().parent.parent / "loadtest" / "prices.yaml"),
                   help="instance prices (YAML)")
    p.set_defaults(func=cmd_cost)

    p = _command(sub, "demo", "synthesize, train, export, serve, check parity, measure")
    p.add_argument("--dataset", choices=("criteo", "movielens100k"), default="criteo",
                   help="criteo: synthetic Criteo-like rows (--rows, --scale, --seed); movielens100k: the real "
                        "MovieLens 100k ratings, downloaded once, with ranking quality (docs/your-data.md)")
    _add_synth(p, 300_000)
    _add_train(p)
    _add_server(p)
    p.add_argument("--keep-serving", action="store_true", help="keep the server up after the demo")
    p.set_defaults(func=cmd_demo)

    p = _command(sub, "engines", "which inference engine scores each DLRM step of a release; --measure re-chooses "
                                 "on this machine")
    p.add_argument("--repository", default="model_repository", help="the Triton model repository")
    p.add_argument("--release", type=int, default=None, help="the release (default: the newest)")
    p.add_argument("--measure", action="store_true",
                   help="measure every engine that runs here at 1, 16, 100 and 1,000 rows and declare the one the "
                        "rule picks (rewrites engine.json and the step's manifest; a server takes it at its next load)")
    p.add_argument("--budget", type=float, default=0.05, help="seconds of calls per engine and point (--measure)")
    p.add_argument("--workdir", default=None,
                   help="the training run's work folder (--measure): its held-out validation rows calibrate int8 and "
                        "its test rows judge bf16 and int8 (test AUC within 0.001 of fp32); without it int8 is not "
                        "measured and bf16 is judged on random rows")
    p.add_argument("--declare", action="append", metavar="STEP=ENGINE",
                   help="declare an engine by hand (c, openvino-f32, openvino-bf16, framework), e.g. "
                        "dlrm_torch=openvino-f32; repeatable")
    p.set_defaults(func=cmd_engines)

    p = _command(sub, "check", "verify the repository against the pinned NGC Triton release (no GPU needed)")
    p.add_argument("--repository", default="model_repository", help="the Triton model repository")
    p.add_argument("--target", choices=["gpu", "cpu"], default="gpu", help="which deployment's configs to check")
    from ensemble.models.triton_releases import PINNED, RELEASES

    p.add_argument("--release", default=PINNED.tag, choices=sorted(RELEASES),
                   help="NGC container release (table in ensemble/models/triton_releases.py)")
    p.add_argument("--treelite-dir", default=None,
                   help="folder with that release's Treelite (default: installed once into ~/.cache/ensemble)")
    p.add_argument("--tensorflow-python", default=None,
                   help="python of an environment with the release's TensorFlow, to run the SavedModel through "
                        "that version's session loader (default: this environment's TensorFlow)")
    p.set_defaults(func=cmd_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # TensorFlow's C++ info and warning lines (CPU features, SavedModel loading, the TFLite
    # converter's notes) say nothing a user of these commands acts on; its errors still show.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # NVTabular calls its CPU mode experimental on every Dataset; the CPU is this project's default
    # path on purpose (the GPU one: docs/gpu-deployment.md).
    warnings.filterwarnings("ignore", message="Initializing an NVTabular Dataset in CPU mode")
    args = build_parser().parse_args(argv)
    # Before any library imports grpc (NVTabular does, through tritonclient): the commands' gRPC
    # clients then poll on their calling threads (ensemble/grpc_polling.py). After the parse, so
    # that --help and argument errors answer without it.
    from ensemble.grpc_polling import import_grpc

    import_grpc()
    from ensemble.dataset import SpecError
    from ensemble.models.manifest import MissingRelease
    from ensemble.repository.declared import DeclaredMissing

    try:
        return args.func(args)
    except (SpecError, MissingRelease, DeclaredMissing) as exc:
        # a spec that cannot describe the data, data that does not match it, a release asked for that
        # the repository does not hold, a declaration that names one: one line, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
