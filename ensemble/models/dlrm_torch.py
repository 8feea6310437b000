"""DLRM in PyTorch, in the parts torchrec names: a bottom MLP (:class:`DenseArch`), the embedding
tables (:class:`SparseArch`), pairwise dot interaction (:class:`InteractionArch`) and a top MLP
(:class:`OverArch`). Exported as frozen TorchScript (``model.pt``), which the CPU layouts run and
Triton's libtorch backend loads in the GPU layout.

Shapes: B = batch, F = 26 categorical columns, D = embedding width, P = (F+1)F/2 = 351 pairs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from ensemble import schema
from ensemble.models import dlrm_kernel, metrics
from ensemble.models.artifacts import TORCHSCRIPT
from ensemble.models.dlrm import DLRMConfig, as_source, score_source, table_offsets
from ensemble.base.device import Device
from ensemble.tables.mlp import MlpWeights

MODEL_FILE = TORCHSCRIPT
LOG = logging.getLogger(__name__)


def _mlp(widths: list[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DenseArch(nn.Module):
    """Bottom MLP: dense features [B x n_dense] -> [B x D] (ReLU after every layer)."""

    def __init__(self, hidden: tuple[int, ...], dim: int, n_dense: int = schema.N_DENSE) -> None:
        super().__init__()
        self.mlp = _mlp([n_dense, *hidden, dim], last_relu=True)

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        return self.mlp(dense)


class SparseArch(nn.Module):
    """Every column's embedding table stacked into one [sum(cardinalities) x D] table.

    Column j's ids are shifted by ``offsets[j]`` (the rows of the tables before it), so the
    lookup of all 26 columns is one gather: ids [B x F] int64 -> [B x F x D]. The same maths
    as one table per column, with one operator call instead of F.
    """

    def __init__(self, cardinalities: tuple[int, ...], dim: int) -> None:
        super().__init__()
        self.table = nn.Embedding(sum(cardinalities), dim)
        nn.init.uniform_(self.table.weight, -0.05, 0.05)
        self.register_buffer("offsets", torch.as_tensor(table_offsets(cardinalities)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(ids + self.offsets)


class InteractionArch(nn.Module):
    """Dot products of every pair among the dense vector and the F embeddings:
    dense [B x D], sparse [B x F x D] -> [B x (D + P)] (the dense vector, then the pairs)."""

    def __init__(self, n_categorical: int) -> None:
        super().__init__()
        rows, cols = torch.tril_indices(n_categorical + 1, n_categorical + 1, offset=-1)
        self.register_buffer("pairs", rows * (n_categorical + 1) + cols)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        stacked = torch.cat([dense.unsqueeze(1), sparse], dim=1)  # B x (F+1) x D
        products = torch.bmm(stacked, stacked.transpose(1, 2)).flatten(1)  # B x (F+1)^2
        return torch.cat([dense, products.index_select(1, self.pairs)], dim=1)


class OverArch(nn.Module):
    """Top MLP: [B x (D + P)] -> one logit [B x 1]."""

    def __init__(self, in_features: int, hidden: tuple[int, ...]) -> None:
        super().__init__()
        self.mlp = _mlp([in_features, *hidden, 1], last_relu=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


class DLRM(nn.Module):
    """(dense [B x 13] float32, ids [B x 26] int64) -> click probability [B x 1].

    Example::

        model = DLRM(DLRMConfig(cardinalities=(10,) * 26))
        model(torch.zeros(4, 13), torch.ones(4, 26, dtype=torch.int64)).shape  # (4, 1)
    """

    def __init__(self, config: DLRMConfig) -> None:
        super().__init__()
        d, n = config.embedding_dim, len(config.cardinalities)
        self.dense_arch = DenseArch(config.bottom_mlp, d, config.n_dense)
        self.sparse_arch = SparseArch(config.cardinalities, d)
        self.interaction = InteractionArch(n)
        self.over_arch = OverArch(d + config.n_interactions(n), config.top_mlp)

    def logits(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.over_arch(self.interaction(self.dense_arch(dense), self.sparse_arch(ids)))

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logits(dense, ids))


class PooledDLRM(nn.Module):
    """The DLRM without its tables: (dense [B x 13], pooled [B x F*D] float32, the rows a row store gathered,
    :mod:`ensemble.tables`) -> click probability [B x 1]. The same parts as :class:`DLRM` but the
    sparse arch, so the same maths.

    Example::

        model = PooledDLRM(DLRMConfig(embedding_dim=16), n_tables=26)
        model(torch.zeros(4, 13), torch.zeros(4, 26 * 16)).shape  # (4, 1)
    """

    def __init__(self, config: DLRMConfig, n_tables: int) -> None:
        super().__init__()
        d = config.embedding_dim
        self.n_tables, self.dim = n_tables, d
        self.dense_arch = DenseArch(config.bottom_mlp, d, config.n_dense)
        self.interaction = InteractionArch(n_tables)
        self.over_arch = OverArch(d + config.n_interactions(n_tables), config.top_mlp)

    def logits(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        sparse = pooled.reshape(-1, self.n_tables, self.dim)
        return self.over_arch(self.interaction(self.dense_arch(dense), sparse))

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logits(dense, pooled))


class PooledFit:
    """A :class:`PooledDLRM`'s MLPs trained with Adam; its rows are a row store's
    (:class:`ensemble.tables.training.TrainingRows`), which this step hands their gradient."""

    def __init__(self, config: DLRMConfig, n_tables: int) -> None:
        torch.manual_seed(config.seed)
        self.model = PooledDLRM(config, n_tables)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=config.learning_rate)
        self.loss_fn = torch.nn.BCEWithLogitsLoss()

    def step(self, dense: np.ndarray, unique: np.ndarray, where: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """One step: the MLPs updated; returns the gradient of the batch's unique rows [U x D]."""
        self.model.train()
        rows = torch.from_numpy(unique).requires_grad_(True)
        pooled = rows[torch.from_numpy(where)].reshape(len(where), -1)
        y = torch.from_numpy(labels).float().reshape(-1, 1)
        loss = self.loss_fn(self.model.logits(torch.from_numpy(dense), pooled), y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return rows.grad.numpy()

    def predict(self, dense: np.ndarray, pooled: np.ndarray) -> np.ndarray:
        self.model.eval()
        with torch.inference_mode():
            out = self.model(torch.from_numpy(np.ascontiguousarray(dense, np.float32)),
                             torch.from_numpy(np.ascontiguousarray(pooled, np.float32).reshape(len(dense), -1)))
        return out.numpy().reshape(-1)

    def load_mlp(self, weights: MlpWeights) -> None:
        """Start from these MLPs (a release's, ``ensemble train --init-from``): continued training."""
        layers = [m for seq in (self.model.dense_arch.mlp, self.model.over_arch.mlp) for m in seq if isinstance(m, nn.Linear)]
        given = [*weights.bottom, *weights.top]
        if [tuple(m.weight.shape) for m in layers] != [tuple(w.T.shape) for w, _ in given]:
            raise ValueError("--init-from: that release's MLPs have other widths than this training's")
        with torch.no_grad():
            for m, (w, b) in zip(layers, given):
                m.weight.copy_(torch.from_numpy(np.ascontiguousarray(w.T)))
                m.bias.copy_(torch.from_numpy(b))

    def mlp_weights(self) -> MlpWeights:
        linears = lambda seq: tuple((np.ascontiguousarray(m.weight.detach().numpy().T, np.float32),  # noqa: E731
                                     np.ascontiguousarray(m.bias.detach().numpy(), np.float32))
                                    for m in seq if isinstance(m, nn.Linear))
        m = self.model
        return MlpWeights.lower_triangle(linears(m.dense_arch.mlp), linears(m.over_arch.mlp), m.n_tables, m.dim)

    def save(self, out_dir: str | Path) -> Path:
        """The pooled model as frozen TorchScript (the framework the engines are checked against, and what
        OpenVINO converts) and its weights in the C pass's layout (``mlp.npz``)."""
        path = Path(out_dir) / MODEL_FILE
        torch.jit.freeze(torch.jit.script(self.model.cpu().eval())).save(str(path))
        self.mlp_weights().save(Path(out_dir))
        return path


def build(config: DLRMConfig) -> DLRM:
    """A freshly initialised :class:`DLRM` (seeded by ``config.seed``)."""
    torch.manual_seed(config.seed)
    return DLRM(config)


class Fit:
    """One training run on a device: the model, Adam, mixed precision on GPU (TF32 too), and the
    epoch with the best validation log loss. Plain training and Slipstream both step it."""

    def __init__(self, config: DLRMConfig, device: Device = Device.CPU) -> None:
        self.use_gpu = device is Device.GPU
        self.dev = torch.device("cuda" if self.use_gpu else "cpu")
        if self.use_gpu:
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self.model = build(config).to(self.dev)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=config.learning_rate)
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.use_gpu)
        self.loss_fn = torch.nn.BCEWithLogitsLoss()
        self.best_loss, self.best_state = float("inf"), None

    def step(self, dense: np.ndarray, ids: np.ndarray, labels: np.ndarray) -> None:
        """One optimizer step on a batch (dense [B x 13] f32, ids [B x 26] i64, labels [B])."""
        d, i = torch.from_numpy(dense).to(self.dev), torch.from_numpy(ids).to(self.dev)
        y = torch.from_numpy(labels).to(self.dev).float().reshape(-1, 1)
        with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=self.use_gpu):
            loss = self.loss_fn(self.model.logits(d, i), y)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def validate(self, valid_source) -> tuple[float, float]:
        """(log loss, AUC) on ``valid_source``; remembers the weights when the loss is the best yet."""
        scores, labels = score_source(lambda d, i: predict(self.model, d, i, self.dev), valid_source)
        loss = metrics.log_loss(labels, scores)
        if loss < self.best_loss:
            self.best_loss = loss
            self.best_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.model.train()
        return loss, metrics.auc(labels, scores)

    def best(self) -> DLRM:
        """The best epoch's model, on the CPU, in eval mode."""
        self.model.load_state_dict(self.best_state)
        return self.model.cpu().eval()


def train(config: DLRMConfig, train_data, valid_data, device: Device = Device.CPU,
          log: Callable[[str], None] = print):
    """Train by streaming batches; keep the epoch with the best validation log loss.

    Args:
        train_data: a batch source (:mod:`ensemble.data.shards`: ``epoch(i)`` yields
            (dense [B x 13] f32, ids [B x 26] i64, labels [B] i8)) or in-memory arrays
            (dense, ids, labels), served as an ``ArraySource`` of ``config.batch_size`` rows.
        valid_data: the same, read in order once per epoch.
        device: "cpu" or "gpu" (mixed precision + TF32 only on GPU).
    """
    train_source = as_source(train_data, config.batch_size, config.seed)
    valid_source = as_source(valid_data, 65536, shuffle=False)
    fit = Fit(config, device)
    for epoch in range(config.epochs):
        fit.model.train()
        for batch in train_source.epoch(epoch):
            fit.step(*batch)
        val_loss, val_auc = fit.validate(valid_source)
        log(f"  dlrm_torch epoch {epoch + 1}: valid logloss {val_loss:.4f} auc {val_auc:.4f}")
    return fit.best()


def predict(model, dense: np.ndarray, ids: np.ndarray, dev=None, batch: int = 65536) -> np.ndarray:
    model.eval()
    out = []
    with torch.inference_mode():
        for start in range(0, len(dense), batch):
            d = torch.as_tensor(dense[start:start + batch], device=dev)
            i = torch.as_tensor(ids[start:start + batch], device=dev)
            out.append(model(d, i).float().cpu().numpy())
    return np.concatenate(out).reshape(-1)


def save(model: DLRM, out_dir: str | Path) -> Path:
    """Script, freeze (weights become constants, only ``forward`` is kept) and save TorchScript:
    what the CPU layouts run and Triton's libtorch backend loads."""
    path = Path(out_dir) / MODEL_FILE
    torch.jit.freeze(torch.jit.script(model.cpu().eval())).save(str(path))
    return path


class TorchScorer:
    """Loads ``model.pt``; ``(dense_features, category_ids) -> [B x 1] float32``.

    ``device="gpu"`` loads the module onto CUDA and copies each batch there and back.
    """

    def __init__(self, model_dir: str | Path, threads: int = 1, device: Device = Device.CPU):
        torch.set_num_threads(threads)
        self._torch = torch
        self._device = torch.device("cuda" if device is Device.GPU else "cpu")
        self.model = torch.jit.load(str(Path(model_dir) / MODEL_FILE), map_location=self._device).eval()
        self.folder = Path(model_dir)
        # On the CPU the same weights through one C call (ensemble/native/_dlrm.c) when it gives
        # TorchScript's scores on a sample batch: 1 row ~15 us instead of ~60-100, 100 rows ~1.6x.
        # The engine the release records for this step (ensemble.models.engines): the C pass or
        # OpenVINO, chosen by measurement at export; said loudly when it cannot run here.
        self._kernel, self.kernel_c, self.weights, self.engine = None, None, None, "framework (GPU)"
        if device is Device.CPU:
            from ensemble.models import engines

            self.weights = dlrm_kernel.DLRMWeights.from_torchscript(self.model)
            if self.weights is None:
                LOG.warning("dlrm_torch: the C forward pass declines this model: its graph is not the exported "
                            "DLRM's shape (linear layers, one stacked table, the pairwise interaction)")
            self.kernel_c, self._kernel, self.engine = engines.attach(Path(model_dir), "dlrm_torch", self.weights,
                                                                      self.framework)

    @property
    def kernel(self) -> "dlrm_kernel.DLRMWeights | None":
        """The C forward pass, when it was checked against the framework at load (what scores then)."""
        return self._kernel

    def __call__(self, dense_features: np.ndarray, category_ids: np.ndarray) -> np.ndarray:
        if self._kernel is not None:
            return self._kernel(dense_features, category_ids)
        return self.framework(dense_features, category_ids)

    def framework(self, dense_features: np.ndarray, category_ids: np.ndarray) -> np.ndarray:
        """The TorchScript module's own forward pass."""
        torch = self._torch
        with torch.inference_mode():
            out = self.model(torch.from_numpy(np.ascontiguousarray(dense_features)).to(self._device),
                             torch.from_numpy(np.ascontiguousarray(category_ids)).to(self._device))
        return out.float().cpu().numpy().reshape(-1, 1)
