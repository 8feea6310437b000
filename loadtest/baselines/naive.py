"""The `naive` baseline: what a team writes first.

Per request: a pandas DataFrame, the saved NVTabular ``Workflow.transform``, an XGBoost
``DMatrix``, the TorchScript model, the TensorFlow SavedModel, then the blend. Same artifacts as
the ranker (read from the same model repository), no batching across requests.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ensemble import schema
from ensemble.models import blend, dlrm_tf, dlrm_torch, xgb
from ensemble.scoring.pipeline import latest_version
from ensemble.schema import Model


class NaiveScorer:
    """``(dense [B x 13] f32, categorical [B x 26] bytes) -> [B] score`` the slow, obvious way."""

    def __init__(self, repository: str | Path, threads: int = 1):
        import tensorflow as tf
        import torch
        import xgboost

        from ensemble.features.transforms import load_workflow

        repo = Path(repository)
        features_dir = latest_version(repo / Model.FEATURES.value)
        self.workflow = load_workflow(features_dir / "workflow")
        # NVTabular 23.08 fails on a categorical column that is null in every row of a call, so
        # every request gets one complete guard row (a known value per column), dropped after.
        self.guard = pd.DataFrame({c: [v] for c, v in zip(
            (*schema.DENSE_COLUMNS, *schema.CATEGORICAL_COLUMNS), self._guard_values(features_dir / "workflow"))})
        self.booster = xgboost.Booster(model_file=str(latest_version(repo / Model.XGB.value) / xgb.MODEL_FILE))
        self.booster.set_param({"nthread": threads})
        torch.set_num_threads(threads)
        self.torch = torch
        self.torch_model = torch.jit.load(str(latest_version(repo / Model.DLRM_TORCH.value) / dlrm_torch.MODEL_FILE))
        self.tf = tf
        self.tf_model = tf.saved_model.load(str(latest_version(repo / Model.DLRM_TF.value) / dlrm_tf.MODEL_DIR))
        self.blender = blend.Blender.load(latest_version(repo / Model.BLEND.value))
        self.xgboost = xgboost

    @staticmethod
    def _guard_values(workflow_dir: Path) -> list:
        import pyarrow.parquet as pq

        values: list = [np.float32(0)] * schema.N_DENSE
        for col in schema.CATEGORICAL_COLUMNS:
            table = pq.ParquetFile(workflow_dir / "categories" / f"unique.{col}.parquet").read(columns=[col])
            values.append(table.column(0)[0].as_py() if table.num_rows else "guard")
        return values

    def __call__(self, dense: np.ndarray, categorical: np.ndarray) -> dict[str, np.ndarray]:
        frame = pd.DataFrame(dense, columns=list(schema.DENSE_COLUMNS))
        frame[~np.isfinite(frame)] = np.nan
        for j, col in enumerate(schema.CATEGORICAL_COLUMNS):
            frame[col] = [v.decode("utf-8", "replace") if v else None for v in categorical[:, j]]
        frame = pd.concat([self.guard, frame], ignore_index=True)
        out = self.workflow.transform(frame).iloc[1:]
        dense_features = out[list(schema.DENSE_COLUMNS)].to_numpy(np.float32)
        ids = out[list(schema.CATEGORICAL_COLUMNS)].to_numpy(np.int64)
        p_xgb = self.booster.predict(self.xgboost.DMatrix(xgb.design_matrix(dense_features, ids))).reshape(-1, 1)
        with self.torch.inference_mode():
            p_torch = self.torch_model(self.torch.from_numpy(dense_features), self.torch.from_numpy(ids)).numpy()
        p_tf = self.tf_model.signatures["serving_default"](
            **{schema.DENSE_FEATURES.name: self.tf.constant(dense_features),
               schema.CATEGORY_IDS.name: self.tf.constant(ids)})[dlrm_tf.SIGNATURE_OUTPUT].numpy()
        score = self.blender(p_xgb.astype(np.float32), p_torch.astype(np.float32), p_tf.astype(np.float32))
        return {schema.SCORE.name: score, schema.SCORE_XGB.name: p_xgb, schema.SCORE_DLRM_TORCH.name: p_torch,
                schema.SCORE_DLRM_TF.name: p_tf}
