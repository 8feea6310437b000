"""Commands that measure and show: `baseline-serve`, `loadtest`, `cost`, `demo`."""

from __future__ import annotations

import json
from pathlib import Path


# `ensemble.data.criteo` imports pandas (~0.4 s): imported inside the commands that use it, so that
# `--help` and argument errors answer at once.


from ensemble.cli.build import _add_train, _train_config
from ensemble.cli.common import _command, _synth_config, _add_synth, _server_options, _add_server

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

    from ensemble.cli.demo import DemoOptions, run_demo

    options = DemoOptions(synth=_synth_config(args), train=_train_config(args), workdir=Path(args.workdir),
                          repository=Path(args.repository), server=_server_options(args),
                          keep_serving=args.keep_serving)
    if args.dataset == "movielens100k":
        from ensemble.cli.demo_movielens import DLRM_EPOCHS, run_movielens_demo

        if args.epochs is None:
            options = replace(options, train=replace(options.train, dlrm=replace(options.train.dlrm, epochs=DLRM_EPOCHS)))
        run_movielens_demo(options)
        return 0
    run_demo(options)
    return 0


def add_commands(sub) -> None:
    """This group's subcommands, in the order `ensemble --help` lists them."""
    p = _command(sub, "baseline-serve", "a CPU baseline server (FastAPI) with the ranker's HTTP contract")
    p.add_argument("--kind", choices=["naive", "inproc"], required=True,
                   help="naive: pandas + NVTabular + the frameworks per request; inproc: the ranker's own pipeline")
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
    p.add_argument("--prices", default=str(Path(__file__).resolve().parents[2] / "loadtest" / "prices.yaml"),
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
