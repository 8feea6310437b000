"""OpenVINO's side of the DLRM engines (:mod:`ensemble.models.engines`): the step's model converted to OpenVINO IR
at export, quantized to int8 by nncf, and run through the C runtime (``ensemble/native/_openvino.c``); the
CPU facts its precisions depend on (bf16 where the CPU has bfloat16 instructions)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np

OPENVINO_DIR = "openvino"
OPENVINO_MODEL = "model.xml"
OPENVINO_INT8 = "model-int8.xml"  # the same model quantized to int8 (nncf), when held-out rows were at hand


def _runtime():
    """``ensemble.native._openvino``, or None when this install was built without the openvino wheel's C
    runtime. Imported on first use: the operator's commands never load OpenVINO."""
    try:
        from ensemble.native import _openvino
    except ImportError:
        return None
    return _openvino

def cpu() -> dict:
    """This machine's CPU model and the instruction-set flags the engines care about (from
    :func:`ensemble.base.machine.cpu`, the one reader of /proc/cpuinfo)."""
    from ensemble.base import machine

    found = machine.cpu()
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx_vnni", "avx512_vnni")
    return {"model": found["name"] if found["name"] != "unknown CPU" else "unknown",
            "flags": [f for f in wanted if f in found["flags"]]}

def has_bf16(machine: dict | None = None) -> bool:
    flags = set((machine or cpu())["flags"])
    return bool(flags & {"avx512_bf16", "amx_bf16"})

def openvino_module():
    """``openvino``, with its usage telemetry off. OpenVINO's converter (and nncf) send usage events to
    Google Analytics, from a process forked off a thread, unless a consent file in the user's home or
    ``CI=true`` says otherwise: an export must not phone home, and that fork, from a process holding
    LiteRT, died with SIGSEGV in the test suite. With ``openvino_telemetry`` unimportable both fall
    back to their own stubs."""
    sys.modules.setdefault("openvino_telemetry", None)
    import openvino

    return openvino

def write_openvino(model_dir: Path, step: str) -> Path:
    """Convert the step's exported model (TorchScript ``model.pt`` or TFLite ``model.tflite``) to OpenVINO
    IR under ``<model_dir>/openvino/``, inputs named ``dense_features`` and ``category_ids`` (fp32 weights
    kept: the precision is chosen when the model is compiled)."""
    ov = openvino_module()

    from ensemble.models import artifacts

    out = Path(model_dir) / OPENVINO_DIR
    out.mkdir(exist_ok=True)
    if step == "dlrm_torch":
        import torch

        module = torch.jit.load(str(Path(model_dir) / artifacts.TORCHSCRIPT)).eval()
        example = (torch.zeros(2, _first_linear_in(module)), torch.zeros(2, _n_ids_torch(module), dtype=torch.int64))
        model = ov.convert_model(module, example_input=example)
    else:
        model = ov.convert_model(str(Path(model_dir) / artifacts.TFLITE))
    model.reshape({port.get_any_name(): [-1, port.get_partial_shape()[1]] for port in model.inputs})
    path = out / OPENVINO_MODEL
    ov.save_model(model, str(path), compress_to_fp16=False)
    return path

def _first_linear_in(module) -> int:
    """The dense inputs of a frozen TorchScript DLRM: its first linear layer's input width."""
    for node in module.graph.nodes():
        if node.kind() == "aten::linear":
            return int(node.inputsAt(1).toIValue().shape[1])
    raise ValueError("no linear layer in the TorchScript DLRM")

def _n_ids_torch(module) -> int:
    """The id columns of a frozen TorchScript DLRM: the length of its table offsets."""
    for node in module.graph.nodes():
        if node.kind() == "aten::add" and node.inputsAt(1).toIValue() is not None:
            return int(node.inputsAt(1).toIValue().numel())
    raise ValueError("no id offsets in the TorchScript DLRM")

def _int8_ignored(model) -> list[str]:
    """The operators int8 would hurt: products of two activations (the pairwise interaction) and the layers
    that read a concatenation (the top MLP's first layer reads the dense vector beside the pairwise dot
    products, whose range one scale per tensor does not hold: quantizing it cost 0.0024 test AUC on the
    seed-size DLRM, against 4e-5 without it)."""
    def source(node, k):
        src = node.input_value(k).get_node()
        while src.get_type_name() in ("Convert", "Reshape", "Transpose", "Unsqueeze"):
            src = src.input_value(0).get_node()
        return src.get_type_name()

    return [op.get_friendly_name() for op in model.get_ops() if op.get_type_name() == "MatMul" and
            ("Constant" not in (source(op, 0), source(op, 1)) or source(op, 0) == "Concat")]

def write_int8(model_dir: Path, calibration: tuple[np.ndarray, np.ndarray]) -> Path:
    """The step's OpenVINO IR quantized to int8 by nncf's post-training quantization, calibrated on
    ``calibration`` (dense, ids) rows, the operators :func:`_int8_ignored` names left as they are."""
    import re

    ov = openvino_module()
    import nncf

    from ensemble.base.console import framework_info_quieted

    folder = Path(model_dir) / OPENVINO_DIR
    model = ov.Core().read_model(str(folder / OPENVINO_MODEL))
    names = [port.get_any_name() for port in model.inputs]
    dense_index = next(k for k, port in enumerate(model.inputs) if port.get_element_type() == ov.Type.f32)
    dense, ids = calibration

    def feed(start: int) -> dict:
        rows = slice(start, start + 100)
        return {names[dense_index]: dense[rows], names[1 - dense_index]: ids[rows]}

    batches = list(range(0, len(dense), 100))
    # nncf's progress bars and per-operator info lines say nothing an export's user acts on; its warnings
    # and errors still show
    nncf.set_log_level(logging.WARNING)
    with framework_info_quieted(re.compile(r"━|^\s*\d+ \S+\s*$")):
        quantized = nncf.quantize(model, nncf.Dataset(batches, feed), subset_size=len(batches),
                                  ignored_scope=nncf.IgnoredScope(names=_int8_ignored(model)))
    path = folder / OPENVINO_INT8
    ov.save_model(quantized, str(path), compress_to_fp16=False)
    return path

class OpenVinoDLRM:
    """A step's OpenVINO engine with the C kernel's interface (``into``, ``native``, ``__call__``); ``precision``
    f32, bf16, or int8 (the quantized model)."""

    def __init__(self, model_dir: Path, precision: str, limits: np.ndarray, n_dense: int, threads: int = 2):
        ov = openvino_module()

        path = Path(model_dir) / OPENVINO_DIR / (OPENVINO_INT8 if precision == "int8" else OPENVINO_MODEL)
        inputs = ov.Core().read_model(str(path)).inputs
        dense_index = next(k for k, port in enumerate(inputs) if port.get_element_type() == ov.Type.f32)
        self.precision = precision
        # int8: the quantized layers in int8, the others in bf16 where the CPU has it
        hint = ("bf16" if has_bf16() else "f32") if precision == "int8" else precision
        self.native = _runtime().Engine(str(path), hint, np.ascontiguousarray(limits, np.int64), n_dense,
                                       dense_index, threads)

    def into(self, dense_features: np.ndarray, category_ids: np.ndarray, out: np.ndarray) -> None:
        self.native(dense_features, category_ids, out)

    def __call__(self, dense_features: np.ndarray, category_ids: np.ndarray) -> np.ndarray:
        dense = np.ascontiguousarray(dense_features, dtype=np.float32)
        out = np.empty(len(dense), np.float32)
        self.native(dense, np.ascontiguousarray(category_ids, dtype=np.int64), out)
        return out.reshape(-1, 1)
