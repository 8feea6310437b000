"""The README's demo figures, from the demo's own summary (``build/demo_summary.json``).

The README marks each generated block with ``<!-- figures:NAME -->`` ... ``<!-- /figures:NAME -->``:

- ``accuracy``: the held-out AUC and log loss of every model and the blend,
- ``example``: what the README's example row scores in-process (and with one category unseen),
- ``demo``: the demo's serving figures (sequential latency, parity, memory).

``python -m ensemble.runs.readme_figures --write`` rewrites the blocks from the summary of the last
``make demo``; ``--check`` (what the demo runs at its end) says whether the README still matches
this build. The demo is deterministic for its seed on a given machine, so ``accuracy`` and
``example`` are compared number by number at the precision the README shows (the machine they name
is not compared); training's float arithmetic differs between CPUs, so on another machine the check
says by how much they differ, and where the README's were made. ``demo`` holds timings, which every
run measures anew: it is rewritten, never compared.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from ensemble.models.registry import ORDER
from ensemble.schema import Model

README = Path(__file__).resolve().parents[2] / "README.md"
SUMMARY = Path("build/demo_summary.json")
COMPARED = ("accuracy", "example")  # deterministic for the demo's seed on one machine
_BLOCK = re.compile(r"(<!-- figures:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /figures:(?P=name) -->)", re.S)


def render(summary: dict) -> dict[str, str]:
    """Block name -> its Markdown, from a demo summary."""
    accuracy = summary["accuracy"]
    rows = [m.value for m in ORDER if m.value in accuracy and m is not Model.FEATURES]
    blocks = {"accuracy": "\n".join(
        ["| model | test AUC | log loss |", "| --- | --- | --- |",
         *(f"| {name} | {accuracy[name]['auc']:.4f} | {accuracy[name]['logloss']:.4f} |" for name in rows)])}
    example = summary.get("example")
    if example:
        blocks["example"] = (f"With the demo model, scored in-process on {summary['machine']}, the row above scores "
                             f"{example['score']:.3f}; with C4 replaced by an unseen value, {example['score_c4_unseen']:.3f}.")
    latency, parity = summary["latency"], summary["parity_max_abs_diff"]
    ms = lambda key: f"{latency[key]['p50_ms']:.2f} / {latency[key]['p99_ms']:.2f} ms"  # noqa: E731
    blocks["demo"] = "\n".join([
        f"From the last `make demo` on {summary['machine']} ("
        f"{summary['layout'] + ' layout, ' if summary.get('layout') else ''}server not pinned; latencies of "
        f"{latency['http_1rows']['n']} sequential requests from one client, p50 / p99):", "",
        "| what | HTTP | gRPC |", "| --- | --- | --- |",
        f"| 1-row request | {ms('http_1rows')} | {ms('grpc_1rows')} |",
        f"| 100-row request | {ms('http_100rows')} | {ms('grpc_100rows')} |", "",
        f"Served scores equal the in-process ones on {summary['parity_rows']:,} fresh rows (largest difference "
        f"{max(parity.values()):.1g}); the server's resident memory is {summary['server_rss_mib']:.0f} MiB."])
    return blocks


def current(readme: str) -> dict[str, str]:
    return {m["name"]: m["body"].rstrip("\n") for m in _BLOCK.finditer(readme)}


def rewrite(readme: str, blocks: dict[str, str]) -> str:
    return _BLOCK.sub(lambda m: f"{m[1]}{blocks.get(m['name'], m['body'].rstrip(chr(10)))}\n{m[4]}", readme)


_DECIMAL = re.compile(r"(?<![\w.])-?\d+\.\d+(?![\w.])")  # the figures; the machine's integers are not


def differences(readme: str, summary: dict) -> dict[str, float]:
    """Compared block -> the largest difference between the README's figures and this summary's,
    at the README's precision (only blocks that differ; ``inf`` when their figures do not pair up)."""
    have, want = current(readme), render(summary)
    found = {}
    for name in COMPARED:
        if name not in want:
            continue
        shown, made = _DECIMAL.findall(have.get(name, "")), _DECIMAL.findall(want[name])
        if len(shown) != len(made):
            found[name] = float("inf")
        elif shown != made:
            found[name] = max(abs(float(a) - float(b)) for a, b in zip(shown, made))
    return found


def stale(readme: str, summary: dict) -> list[str]:
    """The compared blocks whose figures differ, at the README's precision, from this summary's."""
    return list(differences(readme, summary))


def verdict(readme: str, summary: dict) -> str:
    """One line: the README's figures match this build, or by how much they differ and why they may."""
    differ = differences(readme, summary)
    if not differ:
        return "README figures match this build"
    made_on = re.search(r"scored in-process on (.*?), the row above", current(readme).get("example", ""))
    where = f" (the README's were made on {made_on.group(1)}; this is {summary.get('machine')})" if made_on else ""
    return ("README figures differ from this build's by up to "
            + ", ".join(f"{v:g} in {k}" for k, v in differ.items())
            + f"{where}: training's float arithmetic differs between CPUs; python -m ensemble.runs.readme_figures --write "
            "updates them")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ensemble.runs.readme_figures", description=__doc__.splitlines()[0])
    p.add_argument("--summary", default=str(SUMMARY), help="the demo's summary")
    p.add_argument("--readme", default=str(README))
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 when the README's figures differ from the summary's")
    mode.add_argument("--write", action="store_true", help="rewrite the README's figure blocks from the summary")
    args = p.parse_args(argv)
    summary = json.loads(Path(args.summary).read_text())
    readme = Path(args.readme).read_text()
    if args.write:
        Path(args.readme).write_text(rewrite(readme, render(summary)))
        print(f"wrote the figure blocks of {args.readme} from {args.summary}")
        return 0
    print(verdict(readme, summary))
    return 1 if stale(readme, summary) else 0


if __name__ == "__main__":
    sys.exit(main())
