"""Configs come from one typed source; the committed files are exactly what it generates."""

from pathlib import Path

import pytest

from ensemble import schema
from ensemble.repository import configs
from ensemble.models.registry import Layout
from ensemble.schema import Model

REPO = Path(__file__).resolve().parents[2] / "model_repository"


def test_committed_configs_are_generated(tmp_path):
    written = configs.write_configs(tmp_path)
    relative = {p.relative_to(tmp_path).as_posix() for p in written}
    assert relative == {f"{m.value}/{configs.GPU_CONFIG_FILE}" for m in Model} | {
        f"ranker/{configs.config_file(Layout.FUSED)}", f"ranker/{configs.config_file(Layout.NATIVE)}"} | {
        f"{schema.RANK_MODEL}/{configs.config_file(layout)}" for layout in Layout}
    committed = {p.relative_to(REPO).as_posix() for p in REPO.glob("*/**/*.pbtxt")}
    assert committed == relative  # no file of a retired layout left among the committed ones
    for name in sorted(relative):
        assert (REPO / name).read_text() == (tmp_path / name).read_text(), (
            f"{REPO / name} differs from ensemble/repository/configs.py: run `ensemble export` or regenerate")


@pytest.mark.parametrize("layout", list(Layout), ids=lambda layout: layout.value)
@pytest.mark.parametrize("name", [m.value for m in Model])
def test_config_parses_as_triton_model_config(name, layout):
    path = REPO / name / configs.config_file(layout)
    if not path.is_file():
        assert layout is not Layout.GPU and name != "ranker"  # the CPU layouts serve the ranker alone
        return
    config = configs.parse(path.read_text())
    assert config.name == name
    assert config.max_batch_size >= 8192


def test_no_layout_is_the_default_config():
    """Every layout is chosen by name (`--model-config-name`): none hides in config.pbtxt."""
    assert {configs.config_file(layout) for layout in Layout} == {f"configs/{la.value}.pbtxt" for la in Layout}


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


@pytest.mark.parametrize("layout", list(Layout), ids=lambda layout: layout.value)
def test_ranker_contract(layout):
    config = configs.layout_configs(layout)["ranker"]
    assert config.platform == ("ensemble" if layout is Layout.GPU else "")
    assert [(i.name, list(i.dims)) for i in config.input] == [("dense", [13]), ("categorical", [26])]
    assert [o.name for o in config.output] == ["score", "score_xgb", "score_dlrm_torch", "score_dlrm_tf"]


def test_gpu_ensemble_wiring_is_complete():
    config = configs.layout_configs(Layout.GPU)["ranker"]
    available = {t.name for t in schema.RANKER_INPUTS}
    for step in config.ensemble_scheduling.step:
        spec = schema.GPU_STEPS[Model(step.model_name)]
        assert set(step.input_map.values()) == {t.name for t in spec.inputs}
        assert set(step.input_map.values()) <= available, f"{step.model_name} reads a tensor not produced yet"
        available |= set(step.output_map.values())
    assert {t.name for t in schema.RANKER_OUTPUTS} <= available


def test_gpu_python_steps_batch_dynamically_on_the_cpu():
    python = [s for s in configs.layout_specs(Layout.GPU)[0] if s.backend == "python"]
    assert sorted(s.name for s in python) == ["blend", "features"]
    for spec in python:
        config = configs.model_config(spec)
        assert config.HasField("dynamic_batching")
        assert config.instance_group[0].kind == config.instance_group[0].KIND_CPU


def test_no_model_has_a_queue_policy_so_triton_prefetches():
    """Any queue policy or priority level turns off the dynamic batcher's prefetching in Triton 2.51
    (and with it the instance's next batch waits for a wake-up only an accepted request sends)."""
    for layout in Layout:
        for spec in configs.layout_specs(layout)[0]:
            batching = configs.model_config(spec).dynamic_batching
            assert batching.priority_levels == 0 and not batching.priority_queue_policy
            assert not batching.HasField("default_queue_policy")


def test_the_fused_ranker_carries_the_default_latency_objective():
    (ranker,), _ = configs.layout_specs(Layout.FUSED)
    config = configs.model_config(ranker)
    objective = config.parameters[configs.LATENCY_OBJECTIVE_PARAMETER].string_value
    assert float(objective) == configs.DEFAULT_OBJECTIVE_MS
    # the GPU layout's steps refuse nothing
    for spec in configs.layout_specs(Layout.GPU)[0]:
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
