"""The three scorers and the blender, one module each (train, save in the native format, load a
scorer; heavy frameworks imported inside functions only), plus ``registry`` (one Component per
model: artifacts, loader, export hook, GPU serving; the step order), ``artifacts`` (file names),
``metrics`` (AUC, log loss) and ``xgb_gpu`` (in-process GPU trees)."""
