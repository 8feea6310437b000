"""Load a tree model with one specific Treelite version, as Triton's FIL backend would, and predict.

Run by ``ensemble check`` as ``python -I treelite_probe.py TARGET MODEL MODEL_TYPE ALLOW_UNKNOWN
ROWS.npy OUT.npy``: TARGET is a folder holding that Treelite version (``pip install --target``),
put first on ``sys.path`` so it shadows the Treelite of this environment. The child process
keeps the two versions apart. Prints one JSON line: the Treelite version, the model's feature
and tree counts, and the warnings Treelite raised while loading. Imports nothing from ``ensemble``.
"""

from __future__ import annotations

import json
import re
import sys
import warnings


def load(treelite, model_file: str, model_type: str, allow_unknown_field: bool):
    """The loader fil_backend's ``load_tl_base_model`` (src/tl_utils.h) uses for each model_type."""
    frontend = treelite.frontend
    if model_type == "treelite_checkpoint":
        return treelite.Model.deserialize(model_file)
    if model_type == "xgboost_json":
        return frontend.load_xgboost_model(model_file, format_choice="json",
                                           allow_unknown_field=allow_unknown_field)
    if model_type == "xgboost_ubj":
        return frontend.load_xgboost_model(model_file, format_choice="ubjson",
                                           allow_unknown_field=allow_unknown_field)
    if model_type == "xgboost":
        return frontend.load_xgboost_model_legacy_binary(model_file)
    if model_type == "lightgbm":
        return frontend.load_lightgbm_model(model_file)
    raise ValueError(f"unknown model_type {model_type!r}")


def main(argv: list[str]) -> int:
    target, model_file, model_type, allow_unknown, rows_file, out_file = argv
    sys.path.insert(0, target)
    import numpy as np
    import treelite

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load(treelite, model_file, model_type, allow_unknown == "true")
    rows = np.load(rows_file)
    predictions = treelite.gtil.predict(model, rows)  # applies the model's postprocessor (sigmoid)
    np.save(out_file, np.asarray(predictions, dtype=np.float32).reshape(len(rows), -1))
    print(json.dumps({"treelite": treelite.__version__, "treelite_file": treelite.__file__,
                      "num_feature": int(model.num_feature), "num_tree": int(model.num_tree),
                      "warnings": [re.sub(r"^\[[\d:]+\] \S+: ", "", " ".join(str(w.message).split()))
                                   for w in caught]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
