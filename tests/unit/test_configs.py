"""Configs come from one typed source; the committed files are exactly what it generates."""

from pathlib import Path

import pytest

from ensemble import schema
from ensemble.repository import configs
from ensemble.models.registry import Layout
from ensemble.schema import Model

REPO = Path(__file__).resolve().parents[2] / "model_repository"


@pytest.mark.parametrize("relative", [configs.CONFIG_FILE, configs.GPU_CONFIG_FILE])
def test_committed_configs_are_generated(tmp_path, relative):
    written = configs.write_configs(tmp_path)
    assert {p.relative_to(tmp_path).as_posix() for p in written} == {
        f"{m.value}/{r}" for m in Model for r in (configs.CONFIG_FILE, configs.GPU_CONFIG_FILE)} | {
        f"ranker/{configs.config_file(Layout.FUSED)}", f"ranker/{configs.config_file(Layout.NATIVE)}"} | {
        f"{schema.RANK_MODEL}/{configs.config_file(layout)}" for layout in Layout}
    for name in [*configs.all_configs(), schema.RANK_MODEL]:
        committed = REPO / name / relative
        assert committed.read_text() == (tmp_path / name / relative).read_text(), (
            f"{committed} differs from ensemble/repository/configs.py: run `ensemble export` or regenerate")


@pytest.mark.parametrize("relative", [configs.CONFIG_FILE, configs.GPU_CONFIG_FILE])
@pytest.mark.parametrize("name", [m.value for m in Model])
def test_config_parses_as_triton_model_config(name, relative):
    config = configs.parse((REPO / name / relative).read_text())
    assert config.name == name
    assert config.max_batch_size >= 8192


def test_native_layout_is_the_fused_ranker_in_the_projects_backend():
    fused, native = (configs.layout_configs(layout)["ranker"] for layout in (Layout.FUSED, Layout.NATIVE))
    assert native.backend == configs.NATIVE_BACKEND and fused.backend == "python"
    # the native backend lowers its model thread's priority (configs.MODEL_THREAD_NICE); nothing else differs
    nice = native.parameters.pop(configs.THREAD_NICE_PARAMETER)
    assert nice.string_value == str(configs.MODEL_THREAD_NICE) and 0 < configs.MODEL_THREAD_NICE <= 19
    assert configs.THREAD_NICE_PARAMETER not in fused.parameters
    native.backend = fused.backend
    assert native == fused  # same tensors, batching and parameters: one contract, two backends
    for layout in (Layout.FUSED, Layout.NATIVE):
        committed = REPO / "ranker" / configs.config_file(layout)
        assert committed.read_text() == configs.layout_texts(layout)["ranker"], committed


def test_ranker_contract():
    config = configs.layout_configs(Layout.ENSEMBLE)["ranker"]
    assert config.platform == "ensemble"
    assert [(i.name, list(i.dims)) for i in config.input] == [("dense", [13]), ("categorical", [26])]
    assert [o.name for o in config.output] == ["score", "score_xgb", "score_dlrm_torch", "score_dlrm_tf"]


def test_ensemble_wiring_is_complete():
    config = configs.layout_configs(Layout.ENSEMBLE)["ranker"]
    available = {t.name for t in schema.RANKER_INPUTS}
    for step in config.ensemble_scheduling.step:
        spec = schema.STEPS[Model(step.model_name)]
        assert set(step.input_map) == {t.name for t in spec.inputs}
        assert set(step.input_map.values()) <= available, f"{step.model_name} reads a tensor not produced yet"
        available |= set(step.output_map.values())
    assert {t.name for t in schema.RANKER_OUTPUTS} <= available


def test_python_models_batch_dynamically():
    for spec in configs.layout_specs(Layout.ENSEMBLE)[0]:
        config = configs.model_config(spec)
        assert config.backend == "python"
        assert config.HasField("dynamic_batching")
        assert config.instance_group[0].kind == config.instance_group[0].KIND_CPU


def test_no_cpu_model_has_a_queue_policy_so_triton_prefetches():
    """Any queue policy or priority level turns off the dynamic batcher's prefetching in Triton 2.51
    (and with it the instance's next batch waits for a wake-up only an accepted request sends)."""
    for layout in (Layout.FUSED, Layout.ENSEMBLE):
        for spec in configs.layout_specs(layout)[0]:
            batching = configs.model_config(spec).dynamic_batching
            assert batching.priority_levels == 0 and not batching.priority_queue_policy
            assert not batching.HasField("default_queue_policy")


def test_the_fused_ranker_carries_the_default_latency_objective():
    (ranker,), _ = configs.layout_specs(Layout.FUSED)
    config = configs.model_config(ranker)
    objective = config.parameters[configs.LATENCY_OBJECTIVE_PARAMETER].string_value
    assert float(objective) == configs.DEFAULT_OBJECTIVE_MS
    # the per-model layout's steps refuse nothing
    for spec in configs.layout_specs(Layout.ENSEMBLE)[0]:
        assert configs.LATENCY_OBJECTIVE_PARAMETER not in configs.model_config(spec).parameters


def test_the_native_backend_serves_only_the_config_it_was_exported_with():
    """The backend reads the inputs the served config names; a config whose tensors are not the
    ranker's is refused at load, naming both."""
    import json

    from google.protobuf import json_format

    from ensemble.serving import embedded

    config = json.loads(json_format.MessageToJson(configs.layout_configs(Layout.NATIVE)["ranker"],
                                                  preserving_proto_field_name=True))
    embedded._check_config(config, schema.FUSED_STEP)
    config["input"][1]["dims"] = ["25"]
    with pytest.raises(ValueError, match="categorical"):
        embedded._check_config(config, schema.FUSED_STEP)


def test_the_python_rank_model_mirrors_the_rank_nice_value():
    """rank_model.py (a python-backend model: numpy and the schema only) lowers its thread to the
    same nice value the native rank model's config carries."""
    from pathlib import Path

    import ensemble.serving

    text = (Path(ensemble.serving.__file__).parent / "rank_model.py").read_text()
    assert f"\nRANK_NICE = {configs.RANK_THREAD_NICE}  #" in text
