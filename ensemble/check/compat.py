"""``ensemble check --target gpu``: verify, without a GPU, what can be verified of a model
repository against the pinned NGC Triton release (:data:`ensemble.models.triton_releases.PINNED`).

Checks, each reported PASS/FAIL with the file and the reason:

1. configs: every ``configs/gpu.pbtxt`` parses as Triton's ``ModelConfig`` (``--target cpu``: the
   ranker's ``configs/fused.pbtxt`` and ``configs/native.pbtxt``).
2. agreement: seen through the ``ranker`` ensemble's input/output maps, each model's GPU tensors
   are the tensors its step reads and writes on the CPU (``schema.STEPS``: names, dtypes, shapes);
   the only difference is the trees' design matrix (``schema.GPU_STEPS``). The ensemble's client
   contract is the CPU ranker's and fully wired.
3. backends: every backend (or platform) named exists in that release's container.
4. fil: the FIL parameters are ones that release reads, with valid values, required ones present,
   the model file for ``model_type`` present, and the I/O shapes FIL produces.
5. artifacts: the latest version of each model checks against its manifest; the trees load with
   the release's Treelite and predict what XGBoost predicts; ``model.pt`` is libtorch-loadable
   TorchScript matching the config; the SavedModel signature matches the config, and TensorFlow's
   session-based loader (the TensorFlow backend's path) runs it to the same outputs.

What this cannot show is listed by :data:`NOT_VERIFIED` and printed with the report.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ensemble import schema
from ensemble.repository import configs
from ensemble.models import manifest
from ensemble.models import triton_releases
from ensemble.check.loading import IO, ensure_treelite, savedmodel_problems, torchscript_problems, tree_problems
from ensemble.schema import Model

NOT_VERIFIED = (
    "nothing ran on a GPU or in the NGC container: model loading by the FIL, PyTorch and TensorFlow "
    "backends, CUDA execution and latency are unverified",
    "libtorch {libtorch} executing an archive written by this environment's torch (only the file "
    "format version and op namespaces are checked)",
    "the SavedModel on TensorFlow {tensorflow}'s session loader, unless the dlrm_tf line above names that "
    "version (run the check with --tensorflow-python pointing at a python with TensorFlow {tensorflow})",
    "the python-backend steps (features, blend) on the container's Python {python}",
)


@dataclass(frozen=True)
class Finding:
    check: str
    subject: str
    ok: bool
    message: str = ""

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'}  {self.check:<10} {self.subject:<11} {self.message}".rstrip()


@dataclass(frozen=True)
class CheckOptions:
    """Attributes: repository; target ("gpu" or "cpu"); release to check against; treelite_dir
    (a folder with the release's Treelite; default: a cache folder, installed on first use);
    tensorflow_python (the interpreter that runs the SavedModel through TensorFlow's session
    loader; default: this one)."""

    repository: Path
    target: str = "gpu"
    release: triton_releases.TritonRelease = triton_releases.PINNED
    treelite_dir: Path | None = None
    tensorflow_python: str | None = None


def _ios(entries) -> list[IO]:
    pb = configs._pb()
    return [IO(e.name, pb.DataType.Name(e.data_type), tuple(e.dims)) for e in entries]


def _load_configs(repository: Path, relative: str, models: tuple[Model, ...] = tuple(Model)
                  ) -> tuple[dict[str, object], list[Finding]]:
    parsed, findings = {}, []
    for model in models:
        path = repository / model.value / relative
        subject = model.value
        if not path.is_file():
            findings.append(Finding("configs", subject, False, f"{path} is missing; run `ensemble export`"))
            continue
        try:
            config = configs.parse(path.read_text())
        except Exception as exc:  # noqa: BLE001 - protobuf raises ParseError and others
            findings.append(Finding("configs", subject, False, f"{path} does not parse as ModelConfig: {exc}"))
            continue
        if config.name != model.value:
            findings.append(Finding("configs", subject, False, f"{path} names the model '{config.name}'"))
            continue
        parsed[model.value] = config
        findings.append(Finding("configs", subject, True, f"{model.value}/{relative} parses"))
    return parsed, findings


def _views(parsed: dict[str, object]) -> dict[str, dict[str, dict[str, IO]]] | str:
    """model -> {"input"/"output": ensemble tensor name -> the model's IO}, via the ranker's maps."""
    ranker = parsed[Model.RANKER.value]
    views: dict[str, dict[str, dict[str, IO]]] = {}
    for step in ranker.ensemble_scheduling.step:
        model = parsed.get(step.model_name)
        if model is None:
            return f"the ensemble runs unknown model '{step.model_name}'"
        view = {}
        for kind, mapping in (("input", step.input_map), ("output", step.output_map)):
            ios = {io.name: io for io in _ios(getattr(model, kind))}
            if set(mapping) != set(ios):
                return (f"{step.model_name}: the ensemble maps {kind}s {sorted(mapping)}, the model has "
                        f"{sorted(ios)}")
            view[kind] = {mapping[name]: ios[name] for name in mapping}
        views[step.model_name] = view
    return views


def _agreement(gpu: dict) -> list[Finding]:
    findings = []
    contract = [IO(t.name, t.dtype.value, t.dims) for t in (*schema.RANKER_INPUTS, *schema.RANKER_OUTPUTS)]
    ranker = gpu[Model.RANKER.value]
    if [*_ios(ranker.input), *_ios(ranker.output)] != contract:
        findings.append(Finding("agreement", "ranker", False,
                                "GPU ensemble inputs/outputs differ from the client contract in schema.py"))
    views = _views(gpu)
    if isinstance(views, str):
        findings.append(Finding("agreement", "ranker", False, f"GPU ensemble: {views}"))
    if findings:
        return findings
    for model in configs.ORDER:
        name = model.value
        problems = []
        for kind in ("input", "output"):  # schema.GPU_STEPS: the CPU step's tensors and the trees' design matrix
            want = {t.name: t for t in getattr(schema.GPU_STEPS[model], f"{kind}s")}
            seen = views[name][kind]
            for tensor_name in sorted(set(want) | set(seen)):
                tensor, io = want.get(tensor_name), seen.get(tensor_name)
                if tensor is None:
                    problems.append(f"GPU {kind} '{io.name}' carries '{tensor_name}', which the step does not have")
                elif io is None:
                    problems.append(f"{kind} '{tensor_name}' of the step is missing from the GPU config")
                elif (io.dtype, io.dims) != (tensor.dtype.value, tensor.dims):
                    problems.append(f"{kind} '{tensor_name}': GPU '{io.name}' is {io.dtype} {list(io.dims)}, the "
                                    f"step's is {tensor.dtype.value} {list(tensor.dims)}")
        findings.append(Finding("agreement", name, not problems, "; ".join(problems) or
                                "the step's tensors, dtypes and shapes (schema.GPU_STEPS)"))
    available = {t.name for t in schema.RANKER_INPUTS}
    for step in gpu[Model.RANKER.value].ensemble_scheduling.step:
        missing = set(step.input_map.values()) - available
        if missing:
            findings.append(Finding("agreement", "ranker", False, f"{step.model_name} reads {sorted(missing)} "
                                    f"before any step produces it"))
        available |= set(step.output_map.values())
    return findings


def _backends(parsed: dict, available: frozenset[str], where: str) -> list[Finding]:
    findings = []
    for name, config in parsed.items():
        backend = triton_releases.backend_of(config.backend, config.platform)
        ok = backend in available
        findings.append(Finding("backends", name, ok, f"backend '{backend}' is in {where}" if ok else
                                f"backend '{backend}' does not exist in {where} "
                                f"(it has: {', '.join(sorted(available))})"))
    return findings


def _fil(name: str, config, version_dir: Path | None, release: triton_releases.TritonRelease) -> list[str]:
    params = {k: v.string_value for k, v in config.parameters.items()}
    problems = []
    for key, value in sorted(params.items()):
        if key not in release.fil_parameters:
            removed = " (removed in 25.09)" if key in triton_releases.FIL_REMOVED_IN_25_09 else ""
            problems.append(f"parameter '{key}' is not read by the FIL backend of {release.tag}{removed}")
        elif release.fil_parameters[key] is not None and value not in release.fil_parameters[key]:
            problems.append(f"{key}='{value}' is not one of {list(release.fil_parameters[key])}")
    problems += [f"required parameter '{k}' is missing" for k in release.fil_required if k not in params]
    inputs, outputs = _ios(config.input), _ios(config.output)
    if [(i.name, i.dtype, len(i.dims)) for i in inputs] != [("input__0", "TYPE_FP32", 1)]:
        problems.append("FIL takes one TYPE_FP32 input named input__0 with dims [n_features]")
    classifier = params.get(release.fil_classifier_key, params.get("output_class")) == "true"
    want = [2] if params.get("predict_proba") == "true" and classifier else [1]
    if [(o.name, o.dtype, list(o.dims)) for o in outputs] != [("output__0", "TYPE_FP32", want)]:
        problems.append(f"FIL produces one TYPE_FP32 output output__0 with dims {want} for a binary model "
                        f"with these parameters")
    model_type = params.get("model_type", "xgboost")
    if version_dir is not None and model_type in triton_releases.FIL_MODEL_FILES:
        if not (version_dir / triton_releases.FIL_MODEL_FILES[model_type]).is_file():
            problems.append(f"model_type '{model_type}' loads {triton_releases.FIL_MODEL_FILES[model_type]}, "
                            f"absent from {version_dir}")
    return problems


def _latest(repository: Path, name: str) -> Path | None:
    from ensemble.scoring.pipeline import latest_version

    try:
        return latest_version(repository / name)
    except FileNotFoundError:
        return None


def _artifacts(parsed: dict, options: CheckOptions) -> list[Finding]:
    findings = []
    for model in configs.ORDER:
        name, config = model.value, parsed.get(model.value)
        if config is None:
            continue
        version = _latest(options.repository, name)
        backend = triton_releases.backend_of(config.backend, config.platform)
        if backend == "fil":
            problems = _fil(name, config, version, options.release)
            findings.append(Finding("fil", name, not problems, "; ".join(problems) or
                                    f"parameters valid for {options.release.tag}, output [1] = P(click)"))
        if version is None:
            findings.append(Finding("artifacts", name, False, f"no version folder in {options.repository / name}"))
            continue
        try:
            manifest.verify(version, model)
        except manifest.ManifestError as exc:
            findings.append(Finding("artifacts", name, False, str(exc)))
            continue
        inputs, outputs = _ios(config.input), _ios(config.output)
        problems: list[str]
        if backend == "fil":
            params = {k: v.string_value for k, v in config.parameters.items()}
            model_type = params.get("model_type", "xgboost")
            try:
                treelite_dir = ensure_treelite(options.release.treelite, options.treelite_dir)
            except RuntimeError as exc:
                findings.append(Finding("artifacts", name, False, str(exc)))
                continue
            notes: list[str] = []
            problems = tree_problems(version / triton_releases.FIL_MODEL_FILES.get(model_type, ""), model_type,
                                     params.get("xgboost_allow_unknown_field") == "true",
                                     version / "xgboost.json", treelite_dir, options.release.treelite,
                                     inputs[0].dims[0] if inputs and inputs[0].dims else 0, notes=notes)
            ok_text = f"{triton_releases.FIL_MODEL_FILES.get(model_type)} loads with Treelite {options.release.treelite}; " \
                      f"predictions == XGBoost's" + "".join(f" (Treelite: {n})" for n in notes)
        elif backend == "pytorch":
            problems = torchscript_problems(version / "model.pt", inputs, outputs,
                                            options.release.torchscript_max_file_format)
            ok_text = "model.pt is libtorch-loadable TorchScript matching the config"
        elif backend == "tensorflow":
            ran: list[str] = []
            problems = savedmodel_problems(version / "model.savedmodel", inputs, outputs,
                                           tensorflow_python=options.tensorflow_python, notes=ran)
            ok_text = (f"model.savedmodel signature matches the config; TensorFlow {''.join(ran)}'s session-based "
                       f"loader runs it to TensorFlow 2's outputs")
        elif backend == "python":
            problems = [] if (version / "model.py").is_file() else [f"no model.py in {version}"]
            ok_text = "model.py and manifest present"
        else:
            problems, ok_text = [f"no artifact check for backend '{backend}'"], ""
        findings.append(Finding("artifacts", name, not problems, "; ".join(problems) or ok_text))
    return findings


def run_check(options: CheckOptions) -> list[Finding]:
    """Run every check for ``options.target`` and return the findings (none raise)."""
    repository = Path(options.repository)
    if options.target == "cpu":  # the ranker's CPU layouts: the python backend, the project's backend
        findings = []
        for layout, backends in ((configs.Layout.FUSED, {"python"}), (configs.Layout.NATIVE, {configs.NATIVE_BACKEND})):
            parsed, found = _load_configs(repository, configs.config_file(layout), (Model.RANKER,))
            findings += found + _backends(parsed, frozenset(backends), f"the {layout.value} layout")
        return findings
    gpu, findings = _load_configs(repository, configs.GPU_CONFIG_FILE)
    if len(gpu) == len(Model):
        findings += _agreement(gpu)
    findings += _backends(gpu, options.release.backends, options.release.image)
    findings += _artifacts(gpu, options)
    return findings


def report(findings: list[Finding], release: triton_releases.TritonRelease, target: str = "gpu") -> str:
    failed = [f for f in findings if not f.ok]
    header = (f"checked against {release.image} (Triton {release.triton_version}, FIL backend Treelite "
              f"{release.treelite})" if target == "gpu" else "checked the embedded CPU configuration")
    lines = [header, *(f.line() for f in findings), f"{len(findings) - len(failed)} passed, {len(failed)} failed"]
    if target != "gpu":
        return "\n".join(lines)
    lines.append("not verified here (no GPU, no Docker engine):")
    fields = {"libtorch": release.libtorch or "?", "tensorflow": release.tensorflow or "(none)",
              "python": release.python}
    lines += [f"  - {note.format(**fields)}" for note in NOT_VERIFIED]
    return "\n".join(lines)
