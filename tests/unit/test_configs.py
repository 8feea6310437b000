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
        f"ranker/{configs.config_file(Layout.FUSED)}"}
    for name in configs.all_configs():
        committed = REPO / name / relative
        assert committed.read_text() == (tmp_path / name / relative).read_text(), (
            f"{committed} differs from ensemble/repository/configs.py: run `ensemble export` or regenerate")


@pytest.mark.parametrize("relative", [configs.CONFIG_FILE, configs.GPU_CONFIG_FILE])
@pytest.mark.parametrize("name", [m.value for m in Model])
def test_config_parses_as_triton_model_config(name, relative):
    config = configs.parse((REPO / name / relative).read_text())
    assert config.name == name
    assert config.max_batch_size >= 8192


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


def test_ensemble_layout_steps_keep_one_bounded_queue():
    """No priority levels in the per-model layout (Triton 2.51 crashed with them there)."""
    for spec in configs.layout_specs(Layout.ENSEMBLE)[0]:
        batching = configs.model_config(spec).dynamic_batching
        assert batching.priority_levels == 0
        policy = batching.default_queue_policy
        assert (policy.max_queue_size, policy.default_timeout_microseconds) == (
            configs.ENSEMBLE_STEP_QUEUE.max_queue_size, configs.ENSEMBLE_STEP_QUEUE.timeout_us)
        assert policy.allow_timeout_override


def test_cpu_models_queue_interactive_requests_apart_from_batch_scoring():
    models, _ = configs.layout_specs(Layout.FUSED)
    for spec in models:
        batching = configs.model_config(spec).dynamic_batching
        assert batching.priority_levels == len(schema.Priority)
        assert batching.default_priority_level == schema.Priority.INTERACTIVE  # requests naming none
        for level, policy in ((schema.Priority.INTERACTIVE, configs.INTERACTIVE_QUEUE),
                              (schema.Priority.BATCH, configs.BATCH_QUEUE)):
            written = batching.priority_queue_policy[level]
            assert (written.max_queue_size, written.default_timeout_microseconds) == (
                policy.max_queue_size, policy.timeout_us)
            assert written.timeout_action == configs._pb().ModelQueuePolicy.TimeoutAction.REJECT
    # the interactive queue is the short one: a user's request is refused fast, not queued behind batch work
    assert configs.INTERACTIVE_QUEUE.max_queue_size < configs.BATCH_QUEUE.max_queue_size
    assert configs.INTERACTIVE_QUEUE.timeout_us < configs.BATCH_QUEUE.timeout_us
