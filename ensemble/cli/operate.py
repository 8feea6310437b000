"""Commands that serve and change what serves: `tables`, `serve`, `deploy`, `rollback`, `experiment`, `declare`,
`engines`, `check`."""

from __future__ import annotations

import sys
from pathlib import Path


# `ensemble.data.criteo` imports pandas (~0.4 s): imported inside the commands that use it, so that
# `--help` and argument errors answer at once.


from ensemble.cli.common import _command, _server_options, _add_server, _add_fleet

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
    """Which engine scores each DLRM step of the newest release, as the release records it (the server's
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
    for choice in args.choose or ():
        step, _, name = choice.partition("=")
        try:
            engines.set_engine(folders, step, name)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.measure:
        with engines.held_out(Path(args.workdir) / engines.HELD_OUT_DIR if args.workdir else None):
            records = registry.choose_engines_again(folders, args.budget)
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

def cmd_check(args) -> int:
    from ensemble.check.compat import CheckOptions, report, run_check
    from ensemble.models.triton_releases import RELEASES

    release = RELEASES[args.release]
    findings = run_check(CheckOptions(Path(args.repository), args.target, release,
                                      Path(args.treelite_dir) if args.treelite_dir else None,
                                      args.tensorflow_python))
    print(report(findings, release, args.target))
    return 0 if all(f.ok for f in findings) else 1


def add_commands(sub) -> None:
    """This group's subcommands, in the order `ensemble --help` lists them."""
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

    p = _command(sub, "engines", "which inference engine scores each DLRM step of a release; --measure re-chooses "
                                 "on this machine")
    p.add_argument("--repository", default="model_repository", help="the Triton model repository")
    p.add_argument("--release", type=int, default=None, help="the release (default: the newest)")
    p.add_argument("--measure", action="store_true",
                   help="measure every engine that runs here at 1, 16, 100 and 1,000 rows and record the one the "
                        "rule picks (rewrites engine.json and the step's manifest; a server takes it at its next load)")
    p.add_argument("--budget", type=float, default=0.05, help="seconds of calls per engine and point (--measure)")
    p.add_argument("--workdir", default=None,
                   help="the training run's work folder (--measure): its held-out validation rows calibrate int8 and "
                        "its test rows judge bf16 and int8 (test AUC within 0.001 of fp32); without it int8 is not "
                        "measured and bf16 is judged on random rows")
    p.add_argument("--choose", "--declare", dest="choose", action="append", metavar="STEP=ENGINE",
                   help="choose an engine by hand (c, openvino-f32, openvino-bf16, openvino-int8, framework), e.g. "
                        "dlrm_torch=openvino-f32; repeatable (--declare: its former name, kept for one release)")
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
