"""The GPU configuration: generated from the same typed source as the CPU one, parsed as Triton's
ModelConfig, agreeing with the CPU configuration, and the python-side steps it relies on."""


import numpy as np
import pytest

from ensemble import schema
from ensemble.check import compat
from ensemble.repository import configs
from ensemble.models import triton_releases
from ensemble.schema import Model


def _parsed(texts: dict[str, str]) -> dict:
    return {name: configs.parse(text) for name, text in texts.items()}


@pytest.fixture(scope="module")
def gpu():
    return _parsed(configs.all_gpu_configs())


def test_every_model_batches_as_the_cpu_ranker(gpu):
    cpu = configs.layout_configs(configs.Layout.NATIVE)[Model.RANKER.value]
    assert set(gpu) == {m.value for m in Model}
    assert all(gpu[name].name == name and gpu[name].max_batch_size == cpu.max_batch_size for name in gpu)


def test_backends_and_placement(gpu):
    kind = {name: [configs._pb().ModelInstanceGroup.Kind.Name(g.kind) for g in c.instance_group]
            for name, c in gpu.items()}
    assert (gpu["xgb"].backend, kind["xgb"]) == ("fil", ["KIND_GPU"])
    assert (gpu["dlrm_torch"].platform, kind["dlrm_torch"]) == ("pytorch_libtorch", ["KIND_GPU"])
    assert (gpu["dlrm_tf"].platform, kind["dlrm_tf"]) == ("tensorflow_savedmodel", ["KIND_GPU"])
    for name in ("features", "blend"):
        assert (gpu[name].backend, kind[name]) == ("python", ["KIND_CPU"])
    assert gpu["ranker"].platform == "ensemble"
    for name, config in gpu.items():
        assert triton_releases.backend_of(config.backend, config.platform) in triton_releases.PINNED.backends, name


def test_gpu_configs_carry_the_steps_tensors(gpu):
    findings = compat._agreement(gpu)
    assert findings and all(f.ok for f in findings), [f.line() for f in findings if not f.ok]


def test_agreement_catches_a_dtype_change(gpu):
    changed = dict(gpu)
    changed["dlrm_tf"] = configs.parse(configs.all_gpu_configs()["dlrm_tf"])
    changed["dlrm_tf"].input[0].data_type = configs._pb().DataType.Value("TYPE_FP16")
    failed = [f for f in compat._agreement(changed) if not f.ok]
    assert [f.subject for f in failed] == ["dlrm_tf"]
    assert "is TYPE_FP16 [13], the step's is TYPE_FP32 [13]" in failed[0].message


def test_backend_names_map_to_schema_tensors(gpu):
    """libtorch: <name>__<index> in forward() order; FIL: input__0/output__0; TF: signature keys."""
    steps = {s.model_name: s for s in gpu["ranker"].ensemble_scheduling.step}
    assert dict(steps["dlrm_torch"].input_map) == {"dense_features__0": "dense_features",
                                                    "category_ids__1": "category_ids"}
    assert dict(steps["dlrm_torch"].output_map) == {"prob_dlrm_torch__0": "prob_dlrm_torch"}
    assert dict(steps["xgb"].input_map) == {"input__0": schema.XGB_FEATURES.name}
    assert dict(steps["xgb"].output_map) == {"output__0": "prob_xgb"}
    assert dict(steps["dlrm_tf"].output_map) == {"output_0": "prob_dlrm_tf"}
    assert [s.model_name for s in gpu["ranker"].ensemble_scheduling.step] == [m.value for m in configs.ORDER]


def test_fil_parameters_valid_for_pinned_release(gpu):
    assert compat._fil("xgb", gpu["xgb"], None, triton_releases.PINNED) == []
    params = {k: v.string_value for k, v in gpu["xgb"].parameters.items()}
    assert params == {"model_type": "treelite_checkpoint", "output_class": "false", "predict_proba": "false"}
    assert list(gpu["xgb"].output[0].dims) == [1]


def test_fil_parameters_follow_the_release():
    """25.09 renamed output_class to is_classifier: configs generated for one release fail the other."""
    new = configs.parse(configs.all_gpu_configs(triton_releases.RELEASES["25.09"])["xgb"])
    old = configs.parse(configs.all_gpu_configs(triton_releases.PINNED)["xgb"])
    assert compat._fil("xgb", new, None, triton_releases.RELEASES["25.09"]) == []
    assert any("'output_class' is not read by the FIL backend of 25.09 (removed in 25.09)" in p
               for p in compat._fil("xgb", old, None, triton_releases.RELEASES["25.09"]))
    assert any("required parameter 'output_class' is missing" in p
               for p in compat._fil("xgb", new, None, triton_releases.PINNED))


def test_gpu_step_set_matches_cpu_steps(trained):
    """features under layout="gpu" also emits the design matrix; xgb reading it scores the same."""
    from ensemble.models.xgb import design_matrix
    from ensemble.scoring.pipeline import latest_version, load_step

    from tests.helpers import fresh_rows

    repo = trained.repository
    dense, cats = fresh_rows(300, seed=21)
    cpu_features = load_step(Model.FEATURES, latest_version(repo / "features"))
    gpu_features = load_step(Model.FEATURES, latest_version(repo / "features"), layout="gpu")
    assert gpu_features.step.outputs == schema.GPU_STEPS[Model.FEATURES].outputs
    inputs = {schema.DENSE.name: dense, schema.CATEGORICAL.name: cats}
    plain, extended = cpu_features.run(inputs), gpu_features.run(inputs)
    np.testing.assert_array_equal(extended[schema.XGB_FEATURES.name],
                                  design_matrix(plain["dense_features"], plain["category_ids"]))
    cpu_xgb = load_step(Model.XGB, latest_version(repo / "xgb"))
    gpu_xgb = load_step(Model.XGB, latest_version(repo / "xgb"), layout="gpu")
    np.testing.assert_allclose(gpu_xgb.run(extended)["prob_xgb"], cpu_xgb.run(plain)["prob_xgb"], rtol=0, atol=1e-7)


def test_export_writes_the_fil_checkpoint(trained):
    import json

    version = trained.repository / "xgb" / "1"
    assert (version / "checkpoint.tl").is_file() and (version / "xgboost.json").is_file()
    assert "checkpoint.tl" in json.loads((version / "manifest.json").read_text())["files"]
    for model in Model:
        assert (trained.repository / model.value / configs.GPU_CONFIG_FILE).is_file()


def test_device_resolution_without_a_gpu(monkeypatch):
    from ensemble.base import device

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert device.gpu_visible() is False
    assert device.resolve_device("auto") is device.Device.CPU
    assert device.resolve_device("cpu") is device.Device.CPU
    with pytest.raises(device.GpuUnavailable, match="no NVIDIA GPU is visible"):
        device.resolve_device("gpu")
    frame = object()
    assert device.fit_frame(frame, "cpu") == (frame, False)


def test_gpu_libraries_are_never_imported_on_the_cpu_path():
    from tests.helpers import modules_loaded

    code = ("import ensemble.base.device, ensemble.scoring.pipeline, ensemble.check.compat, ensemble.repository.configs, "
            "ensemble.cli\n"
            "ensemble.repository.configs.all_gpu_configs()")
    assert modules_loaded(code, ("cudf", "cupy", "cuml", "nvforest", "dask_cudf", "rmm")) == []


def _warmup(config) -> dict[str, dict[str, tuple[str, tuple[int, ...], str]]]:
    """sample name -> input name -> (TYPE_*, dims, data field) of a parsed config's warm-up."""
    pb = configs._pb()
    return {s.name: {name: (pb.DataType.Name(i.data_type), tuple(i.dims), i.WhichOneof("input_data_type"))
                     for name, i in s.inputs.items()} for s in config.model_warmup}


def test_every_composing_model_warms_up_on_its_own_tensors():
    """Triton runs the samples before the model is ready: a model that cannot infer fails at load."""
    parsed = _parsed(configs.layout_texts(configs.Layout.GPU))
    batches = configs.GPU_WARMUP_BATCHES
    models, _ = configs.layout_specs(configs.Layout.GPU)
    assert {s.name for s in models} == {m.value for m in configs.ORDER}
    for spec in models:
        config = parsed[spec.name]
        assert [(s.name, s.batch_size, s.count) for s in config.model_warmup] == \
            [(f"{spec.name}_batch_{b}", b, 0) for b in batches], spec.name
        # Exactly the config's inputs, with their dtypes and dims: a mismatch fails the load itself.
        declared = {i.name: (configs._pb().DataType.Name(i.data_type), tuple(i.dims)) for i in config.input}
        for sample in _warmup(config).values():
            assert {n: v[:2] for n, v in sample.items()} == declared, spec.name
    assert not parsed[Model.RANKER.value].model_warmup  # an ensemble has no warm-up of its own


def test_warmup_data_is_valid_for_each_dtype(gpu):
    """Ids are zeros (inside every embedding table), strings empty (missing), floats random."""
    samples = _warmup(gpu["dlrm_torch"])["dlrm_torch_batch_1"]
    assert samples == {"dense_features__0": ("TYPE_FP32", (13,), "random_data"),
                       "category_ids__1": ("TYPE_INT64", (26,), "zero_data")}
    assert _warmup(gpu["dlrm_tf"])["dlrm_tf_batch_64"]["category_ids"][2] == "zero_data"
    assert _warmup(gpu["xgb"])["xgb_batch_1"] == {"input__0": ("TYPE_FP32", (39,), "random_data")}
    assert _warmup(gpu["features"])["features_batch_1"]["categorical"] == ("TYPE_STRING", (26,), "zero_data")
    for tensor in (schema.CATEGORY_IDS, schema.CATEGORICAL):
        assert configs.warmup_data(tensor) is configs.WarmupData.ZERO


def test_fused_ranker_warms_up_in_its_model_py_not_its_config():
    fused = _parsed(configs.layout_texts(configs.Layout.FUSED))[Model.RANKER.value]
    assert not fused.model_warmup


def test_gpu_tree_scorer_reads_the_treelite_checkpoint():
    """In-process FIL loads checkpoint.tl (what FIL's older Treelite can read), never xgboost.json."""
    import inspect

    from ensemble.models import xgb, xgb_gpu

    assert triton_releases.FIL_MODEL_FILES[xgb_gpu.FIL_MODEL_TYPE] == xgb.FIL_FILE
    source = inspect.getsource(xgb_gpu._load_fil)
    assert "xgboost_json" not in source and source.count("model_type=FIL_MODEL_TYPE") == 2
    scorer = inspect.getsource(xgb_gpu.GpuTreeScorer.__init__)
    assert "xgb.FIL_FILE" in scorer and "xgb.MODEL_FILE" in scorer  # checkpoint first, JSON for XGBoost


def test_gpu_tree_scorer_without_cuda_libraries_says_what_is_missing(trained):
    from ensemble.base import device
    from ensemble.models.xgb_gpu import GpuTreeScorer

    if device.has_module("cupy"):
        pytest.skip("cupy is installed here")
    with pytest.raises(device.GpuUnavailable, match="'cupy'"):
        GpuTreeScorer(trained.repository / "xgb" / "1")


def test_the_gpu_layouts_trees_split_the_design_matrix_at_the_datasets_dense_width():
    from ensemble.models.registry import BY_MODEL, Layout

    seen = []
    xgb = BY_MODEL[Model.XGB].adapt(lambda dense, ids: seen.append((dense, ids)), Layout.GPU, n_dense=3)
    xgb(np.arange(10, dtype=np.float32).reshape(1, 10))
    dense, ids = seen[0]
    assert dense.tolist() == [[0, 1, 2]] and ids.tolist() == [[3, 4, 5, 6, 7, 8, 9]] and ids.dtype == np.int64
