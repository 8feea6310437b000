"""Load a SavedModel the way Triton's TensorFlow backend does and run its signature once.

Triton's ``tensorflow_savedmodel`` platform loads through TensorFlow's C++ ``LoadSavedModel``:
a TF1 graph in a ``Session``, variables restored by the saver's restore op, then
``Session::Run`` on the signature's tensors. That is a different path from TensorFlow 2's
``tf.saved_model.load`` (eager, object graph), and Keras 3 exports are known to load on it and
then fail at the first run (``FAILED_PRECONDITION: Could not find variable ...``; server#7456,
tensorflow#72963). ``tf.compat.v1.saved_model.loader.load`` in a ``Session`` is the Python face
of the same loader (``saved_model_cli run`` uses it too, and reproduces those failures).

Run by ``ensemble check`` as ``python -I savedmodel_probe.py MODEL_DIR SPEC.json OUT_DIR``, in a
child process: graph mode must not leak into the caller, and the interpreter may be another
environment's (e.g. one with the pinned container's TensorFlow). SPEC.json is
``{"signature": name, "inputs": {name: "input.npy"}, "outputs": [name, ...]}``; each output is
saved as ``OUT_DIR/<name>.npy``. Prints one JSON line (TensorFlow version, output dtypes and
shapes). Imports nothing from ``ensemble``.
"""

from __future__ import annotations

import json
import os
import sys


def run(model_dir: str, spec: dict, out_dir: str) -> dict:
    """Load ``model_dir`` with the session loader, feed the spec's inputs, save the outputs.

    Returns:
        {"tensorflow": version, "outputs": {name: {"dtype": str, "shape": [int, ...]}}}
    """
    import numpy as np
    import tensorflow as tf

    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default(), v1.Session(graph=graph) as session:
        meta = v1.saved_model.loader.load(session, [v1.saved_model.tag_constants.SERVING], model_dir)
        signature = meta.signature_def[spec["signature"]]
        feeds = {graph.get_tensor_by_name(signature.inputs[name].name): np.load(path)
                 for name, path in spec["inputs"].items()}
        names = list(spec["outputs"])
        fetched = session.run([graph.get_tensor_by_name(signature.outputs[n].name) for n in names], feed_dict=feeds)
    outputs = {}
    for name, value in zip(names, fetched):
        np.save(os.path.join(out_dir, f"{name}.npy"), value)
        outputs[name] = {"dtype": str(value.dtype), "shape": list(value.shape)}
    return {"tensorflow": tf.__version__, "outputs": outputs}


def main(argv: list[str]) -> int:
    model_dir, spec_file, out_dir = argv
    with open(spec_file) as handle:
        spec = json.load(handle)
    print(json.dumps(run(model_dir, spec, out_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
