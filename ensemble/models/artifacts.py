"""File names of every model artifact inside a version folder (and in the training work folder).

Kept apart from the model modules so that the registry, export and checks can name files without
importing torch, TensorFlow or XGBoost.
"""

XGB_JSON = "xgboost.json"  # XGBoost's own model file (training output)
# What the GPU layout's FIL backend loads (model_type "treelite_checkpoint"): the FIL backend of
# the pinned container links Treelite 4.4.1, which cannot parse the JSON that XGBoost 3.x writes
# (an unknown "cats" key, then base_score written as a vector "[2.5E-1]"), the failure users
# report in fil_backend issues #311 and #378 for earlier version pairs.
FIL_CHECKPOINT = "checkpoint.tl"
TORCHSCRIPT = "model.pt"  # the torch DLRM (TorchScript, frozen), also what libtorch loads
SAVEDMODEL = "model.savedmodel"  # the Keras DLRM as a SavedModel (the GPU layout's TensorFlow backend)
SAVEDMODEL_OUTPUT = "output_0"  # the output key Keras `model.export` gives its serving signature
TFLITE = "model.tflite"  # the same SavedModel converted for TensorFlow Lite (CPU layouts)
BLEND_JSON = "blend.json"
WORKFLOW = "workflow"  # the fitted NVTabular workflow folder (+ lean.json)
MLP_WEIGHTS = "mlp.npz"  # a row store DLRM's MLPs in the C pass's layout (ensemble.tables.mlp)
TOUCHED_ROWS = "touched"  # the rows a row store DLRM's training touched (ensemble.tables.training), export-only
