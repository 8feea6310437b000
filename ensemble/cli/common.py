"""Helpers every command group uses: the help formatter, a subcommand's parser, the options shared between
groups (the synthetic data's, the server's and the fleet's)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ensemble.models.registry import Layout
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

def _add_synth(p: argparse.ArgumentParser, rows: int) -> None:
    p.add_argument("--rows", type=int, default=rows, help="rows to generate")
    p.add_argument("--scale", type=float, default=0.01,
                   help="category cardinalities as a fraction of Criteo's (1.0 = millions of values)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the generator")

def _widths(text: str) -> tuple[int, ...]:
    from ensemble.base.model_size import SizeError, widths

    try:
        return widths(text)
    except SizeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None

def dataset_shapes() -> tuple[str, ...]:
    from ensemble.dataset import TABLE_SHAPES

    return tuple(TABLE_SHAPES)

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
                         require_engine=getattr(args, "require_engine", False), store=_store(args),
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
                        "default); fused: the ranker as one python-backend model (the fallback); gpu: a Triton "
                        "ensemble of the NGC container's FIL, libtorch and TensorFlow backends")
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
    p.add_argument("--require-engine", "--require-declared", dest="require_engine", action="store_true",
                   help="refuse to start when a DLRM step's recorded engine (the release's engine.json) cannot "
                        "run on this machine, instead of scoring with the C pass or the framework (logged); "
                        "--require-declared is its former name, kept for one release")
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
