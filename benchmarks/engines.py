"""The engine study: one DLRM step scored by every inference engine this machine has, at both model sizes
(``ensemble.base.model_size.SIZES``), at 1, 16, 100 and 1,000 rows, one thread on one core.

Engines, each on the same weights (random, seeded; 26 tables of ``--table-rows`` rows):

- ``c``: the project's forward pass (``ensemble/native/_dlrm.c``), weights read from the frozen TorchScript;
- ``torchscript``: the frozen TorchScript module (what ``dlrm_torch.save`` exports) in libtorch, fp32, and
  ``torchscript-bf16``: the same module with its weights and products in bfloat16 (oneDNN);
- ``onnxruntime``: the module exported to ONNX, ONNX Runtime's CPU provider, fp32;
- ``openvino``: the ONNX model compiled by OpenVINO's CPU plugin, fp32, and ``openvino-bf16`` (its
  inference precision hint; the plugin uses bf16 only where the CPU has bf16 instructions);
- for the Keras DLRM (``--tf``): ``litert`` (its TFLite conversion, what the CPU layouts run), ``c`` and
  ``openvino`` (from the TFLite file);
- ``served:<engine>``: the engines a release can record (``ensemble.models.engines``), called through their
  C entry points as the server calls them, ``served:openvino-int8`` included (calibrated here on random rows:
  a speed figure; a release judges int8's accuracy on its held-out rows).

Every engine's scores are compared with the fp32 framework's on the measured rows (the largest difference
is in the table). Engines alternate within each repetition, so the VM's drifts in speed hit them alike;
a point is the best of ``--repeats`` repetitions. Not a test: prints a table and writes
``<out>/engines.json`` (machine, command, every point). ::

    .venv/bin/python -m benchmarks.engines --cpu 1 --out docs/results/engines
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks import write_results
from ensemble.base.machine import summary
from ensemble.models.engines import per_row_us

ROWS = (1, 16, 100, 1000)
CALIBRATION_ROWS = 3000
N_DENSE, N_COLUMNS = 13, 26


def torch_model(size, table_rows: int, seed: int = 0):
    """A DLRM of ``size``'s widths with random weights (eval mode)."""
    from ensemble.models import dlrm_torch
    from ensemble.models.dlrm import DLRMConfig

    config = DLRMConfig(embedding_dim=size.embedding_dim, bottom_mlp=size.bottom_mlp, top_mlp=size.top_mlp,
                        cardinalities=(table_rows,) * N_COLUMNS, seed=seed)
    return dlrm_torch.build(config).eval()


def inputs(rows: int, table_rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(rows, N_DENSE)).astype(np.float32),
            rng.integers(0, table_rows, size=(rows, N_COLUMNS)).astype(np.int64))


def torch_engines(model, folder: Path) -> dict:
    """name -> f(dense, ids) -> [rows] float32, for the torch DLRM."""
    import torch

    from ensemble.models import dlrm_kernel, dlrm_torch

    engines = {}
    path = dlrm_torch.save(model, folder)
    scripted = torch.jit.load(str(path)).eval()

    def run_torch(module, cast=None):
        def f(dense, ids):
            with torch.inference_mode():
                d = torch.from_numpy(dense)
                out = module(d if cast is None else d.to(cast), torch.from_numpy(ids))
            return out.float().numpy().reshape(-1)
        return f

    engines["torchscript"] = run_torch(scripted)
    weights = dlrm_kernel.DLRMWeights.from_torchscript(scripted)
    if weights is not None and dlrm_kernel.available():
        engines["c"] = lambda d, i: weights(d, i).reshape(-1)
    import copy

    half = copy.deepcopy(model).to(torch.bfloat16).eval()
    engines["torchscript-bf16"] = run_torch(torch.jit.freeze(torch.jit.script(half)), torch.bfloat16)

    onnx_path = folder / "model.onnx"
    dense, ids = inputs(4, 2, 0)
    torch.onnx.export(model, (torch.from_numpy(dense), torch.from_numpy(ids)), str(onnx_path), dynamo=False,
                      input_names=["dense", "ids"], output_names=["p"],
                      dynamic_axes={"dense": {0: "rows"}, "ids": {0: "rows"}, "p": {0: "rows"}})
    engines.update(onnx_engines(onnx_path, ("dense", "ids")))
    engines.update(served(folder, "dlrm_torch", dlrm_torch.TorchScorer(folder)))
    return engines


def onnx_engines(path: Path, names: tuple[str, str]) -> dict:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    engines = {"onnxruntime": lambda d, i: session.run(None, {names[0]: d, names[1]: i})[0].reshape(-1)}
    engines.update(openvino_engines(path))
    return engines


def openvino_engines(path: Path, order: tuple[int, int] = (0, 1)) -> dict:
    """OpenVINO's CPU plugin on a model file (ONNX or TFLite), fp32 and bf16; ``order``: which of the
    model's inputs take (dense, ids)."""
    import openvino as ov

    core = ov.Core()
    engines = {}
    for precision in ("f32", "bf16"):
        compiled = core.compile_model(str(path), "CPU", {"INFERENCE_NUM_THREADS": 1, "NUM_STREAMS": 1,
                                                         "PERFORMANCE_HINT": "LATENCY",
                                                         "INFERENCE_PRECISION_HINT": precision})
        if precision != "f32" and compiled.get_property("INFERENCE_PRECISION_HINT") != ov.Type.bf16:
            continue  # this CPU has no bf16: the plugin keeps f32
        request = compiled.create_infer_request()

        def f(d, i, request=request):
            values = [None, None]
            values[order[0]], values[order[1]] = d, i
            request.infer(values, share_inputs=True)
            return request.get_output_tensor(0).data.reshape(-1).copy()
        engines["openvino" if precision == "f32" else "openvino-bf16"] = f
    return engines


def tf_engines(size, table_rows: int, folder: Path, seed: int = 0) -> dict:
    """name -> f(dense, ids), for the Keras DLRM (its TFLite conversion is the fp32 framework)."""
    from ensemble.models import dlrm_tf
    from ensemble.models.dlrm import DLRMConfig

    config = DLRMConfig(embedding_dim=size.embedding_dim, bottom_mlp=size.bottom_mlp, top_mlp=size.top_mlp,
                        cardinalities=(table_rows,) * N_COLUMNS, seed=seed)
    model = dlrm_tf.build(config)
    dlrm_tf.save(model, folder)
    dlrm_tf.write_tflite(folder)
    scorer = dlrm_tf.TFScorer(folder)
    engines = {"litert": lambda d, i: scorer.framework(d, i).reshape(-1)}
    if scorer.kernel_c is not None:
        engines["c"] = lambda d, i: scorer.kernel_c(d, i).reshape(-1)
    state = scorer._interpreter()
    order = (0, 1) if state[1] < state[2] else (1, 0)
    try:
        engines.update(openvino_engines(folder / dlrm_tf.TFLITE, order))
    except RuntimeError as exc:
        print(f"openvino: the TFLite model did not compile ({exc})", file=sys.stderr)
    engines.update(served(folder, "dlrm_tf", scorer))
    return engines


def served(folder: Path, step: str, scorer) -> dict:
    """The engines a server can record for the step (``ensemble.models.engines``), called as the native
    backend calls them (C entry points; here through their Python wrappers), named ``served:<engine>``."""
    from ensemble.models import dlrm_kernel, engines

    engines.write_openvino(folder, step)
    weights = scorer.weights
    limits, n_dense = dlrm_kernel.cardinalities(weights), weights.bottom[0][0].shape[0]
    # int8 calibrated on random rows of the tables (the weights are random too: this measures speed only)
    engines.write_int8(folder, inputs(CALIBRATION_ROWS, int(limits.min()), 99))
    found = engines.candidates(folder, None, limits, n_dense, engines.cpu())
    return {f"served:{name}": (lambda d, i, f=f: f(d, i).reshape(-1)) for name, f in found.items()}


def measure(engines: dict, table_rows: int, repeats: int, budget: float) -> list[dict]:
    points = []
    for rows in ROWS:
        dense, ids = inputs(rows, table_rows, rows)
        reference = next(iter(engines.values()))(dense, ids)
        gaps = {name: float(np.abs(f(dense, ids) - reference).max()) for name, f in engines.items()}
        best = per_row_us(engines, dense, ids, repeats, budget)
        for name in engines:
            points.append({"rows": rows, "engine": name, "us_per_row": round(best[name], 3),
                           "max_abs_diff": gaps[name]})
    return points


def main(argv=None) -> int:
    from ensemble.base import model_size

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="demo,seed")
    parser.add_argument("--table-rows", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget", type=float, default=0.2, help="seconds of calls per engine and repetition")
    parser.add_argument("--cpu", type=int, default=None, help="pin this process to one core")
    parser.add_argument("--tf", action="store_true", help="the Keras DLRM too")
    parser.add_argument("--out", default="results")
    args = parser.parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    import torch

    torch.set_num_threads(1)
    points = []
    for name in args.sizes.split(","):
        size = model_size.SIZES[name]
        with tempfile.TemporaryDirectory() as tmp:
            studies = {"dlrm_torch": torch_engines(torch_model(size, args.table_rows), Path(tmp))}
            if args.tf:
                tf_dir = Path(tmp) / "tf"
                tf_dir.mkdir()
                studies["dlrm_tf"] = tf_engines(size, args.table_rows, tf_dir)
            for step, engines in studies.items():
                for point in measure(engines, args.table_rows, args.repeats, args.budget):
                    points.append({"size": name, "step": step, **point})
                    print(f"{name:5} {step:10} {point['rows']:5} {point['engine']:18} "
                          f"{point['us_per_row']:10.2f} us/row  diff {point['max_abs_diff']:.1e}", flush=True)
    write_results(args.out, "engines.json", "benchmarks.engines", summary(), points=points,
                  table_rows=args.table_rows, repeats=args.repeats, cpu=args.cpu)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
