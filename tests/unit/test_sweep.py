"""`python -m loadtest.sweep` writes the ranker config of the layout it measures, with the batcher
settings of the point, from the typed builder (no server here: the sweep itself is a benchmark)."""

from __future__ import annotations

import pytest
from google.protobuf import text_format

from ensemble.models.registry import Layout
from ensemble.repository import configs
from ensemble.schema import Model
from loadtest.sweep import _repository_with


@pytest.mark.parametrize("layout", [Layout.NATIVE, Layout.FUSED], ids=lambda layout: layout.value)
def test_the_sweep_writes_the_layouts_ranker_config_with_the_points_settings(trained, tmp_path, layout):
    from tritonclient.grpc import model_config_pb2

    repo = _repository_with(trained.repository, tmp_path, layout, queue_delay_us=250, instances=2)
    written = model_config_pb2.ModelConfig()
    text_format.Parse((repo / Model.RANKER.value / configs.config_file(layout)).read_text(), written)
    assert written.dynamic_batching.max_queue_delay_microseconds == 250
    assert [group.count for group in written.instance_group] == [2]
    expected = model_config_pb2.ModelConfig()
    text_format.Parse((trained.repository / Model.RANKER.value / configs.config_file(layout)).read_text(), expected)
    expected.dynamic_batching.max_queue_delay_microseconds = 250
    expected.instance_group[0].count = 2
    assert written == expected  # nothing else changed
