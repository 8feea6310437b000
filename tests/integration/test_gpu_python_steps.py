"""What of the GPU layout runs without a GPU: its python steps (features, blend) loaded by the real
tritonserver from their ``configs/gpu.pbtxt``, answering what the in-process steps of that layout
answer. The FIL, libtorch and TensorFlow steps need the NGC container (`ensemble check --target gpu`
checks their files instead)."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from ensemble import schema
from ensemble.base.machine import free_port
from ensemble.models.registry import Layout
from ensemble.operate import lifecycle
from ensemble.operate.server import ServerOptions, TritonServer, _backend_directory, find_tritonserver
from ensemble.scoring.pipeline import latest_version, load_step
from ensemble.schema import Model
from tests.helpers import ADMIN_KEY, fresh_rows

PYTHON_STEPS = (Model.FEATURES, Model.BLEND)


@pytest.fixture(scope="module")
def gpu_python_steps(trained, tmp_path_factory):
    """A tritonserver of the GPU layout's configs with only its python steps loaded."""
    scratch = tmp_path_factory.mktemp("gpu-python-steps")
    server = TritonServer(ServerOptions(trained.repository, http_port=free_port(), grpc_port=free_port(),
                                        metrics_port=free_port(), layout=Layout.GPU, admin_key=ADMIN_KEY))
    binary = find_tritonserver()
    command = [arg for arg in server.command(binary, _backend_directory(binary, scratch))
               if not arg.startswith("--load-model=")] + [f"--load-model={m.value}" for m in PYTHON_STEPS]
    log = scratch / "tritonserver.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=server.environment(binary),
                                   start_new_session=True)
    try:
        lifecycle.wait_ready(f"http://{server.http_url}", process, timeout=180, what="tritonserver")
    except RuntimeError as exc:
        process.kill()
        pytest.fail(f"{exc}\n{log.read_text()[-4000:]}")
    yield server.http_url
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()


def _served(url: str, model: Model, inputs: dict[str, np.ndarray], outputs: tuple[str, ...]) -> dict[str, np.ndarray]:
    import tritonclient.http as http
    from tritonclient.utils import np_to_triton_dtype

    client = http.InferenceServerClient(url)
    try:
        tensors = []
        for name, array in inputs.items():
            tensor = http.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        result = client.infer(model.value, tensors, outputs=[http.InferRequestedOutput(o) for o in outputs])
        return {o: result.as_numpy(o) for o in outputs}
    finally:
        client.close()


def test_gpu_layout_python_steps_answer_as_in_process(trained, gpu_python_steps):
    dense, cats = fresh_rows(64, seed=31)
    features = load_step(Model.FEATURES, latest_version(trained.repository / "features"), layout=Layout.GPU)
    want = features.run({schema.DENSE.name: dense, schema.CATEGORICAL.name: cats})
    # the GPU layout's features also emit the trees' design matrix, which FIL reads
    assert set(want) == {t.name for t in schema.GPU_STEPS[Model.FEATURES].outputs} and schema.XGB_FEATURES.name in want
    got = _served(gpu_python_steps, Model.FEATURES, {schema.DENSE.name: dense, schema.CATEGORICAL.name: cats},
                  tuple(want))
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)

    rng = np.random.default_rng(5)
    probabilities = {t.name: rng.random((64, 1), dtype=np.float32) for t in schema.GPU_STEPS[Model.BLEND].inputs}
    blend = load_step(Model.BLEND, latest_version(trained.repository / "blend"), layout=Layout.GPU)
    want = blend.run(probabilities)
    got = _served(gpu_python_steps, Model.BLEND, probabilities, tuple(want))
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-6, err_msg=name)


def test_gpu_layout_python_step_refuses_bad_input_and_keeps_serving(gpu_python_steps):
    from tritonclient.utils import InferenceServerException

    dense, cats = fresh_rows(4, seed=32)
    with pytest.raises(InferenceServerException, match="categorical"):
        _served(gpu_python_steps, Model.FEATURES, {schema.DENSE.name: dense, schema.CATEGORICAL.name: cats[:, :3]},
                (schema.DENSE_FEATURES.name,))
    got = _served(gpu_python_steps, Model.FEATURES, {schema.DENSE.name: dense, schema.CATEGORICAL.name: cats},
                  (schema.DENSE_FEATURES.name,))
    assert got[schema.DENSE_FEATURES.name].shape == dense.shape
