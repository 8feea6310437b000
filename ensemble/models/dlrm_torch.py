"""DLRM in PyTorch: bottom MLP, one embedding table per categorical column, pairwise dot
interaction, top MLP. Exported as TorchScript (``model.pt``)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from ensemble import metrics, schema
from ensemble.models.dlrm import DLRMConfig, minibatches

MODEL_FILE = "model.pt"


def build(config: DLRMConfig):
    """Return a ``torch.nn.Module``: ``(dense [B x 13] f32, ids [B x 26] i64) -> [B x 1] prob``."""
    import torch
    from torch import nn

    def mlp(widths: list[int], last_relu: bool) -> nn.Sequential:
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
            layers.append(nn.Linear(a, b))
            if last_relu or i < len(widths) - 2:
                layers.append(nn.ReLU())
        return nn.Sequential(*layers)

    class DLRM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = config.embedding_dim
            self.bottom = mlp([schema.N_DENSE, *config.bottom_mlp, d], last_relu=True)
            self.embeddings = nn.ModuleList(nn.Embedding(n, d) for n in config.cardinalities)
            for table in self.embeddings:
                nn.init.uniform_(table.weight, -0.05, 0.05)
            n_interactions = config.n_interactions(len(config.cardinalities))
            self.top = mlp([d + n_interactions, *config.top_mlp, 1], last_relu=False)
            rows, cols = torch.tril_indices(len(config.cardinalities) + 1,
                                            len(config.cardinalities) + 1, offset=-1)
            self.register_buffer("tril_rows", rows)
            self.register_buffer("tril_cols", cols)

        def logits(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            bottom = self.bottom(dense)  # B x d
            vectors = [bottom]
            for j, table in enumerate(self.embeddings):
                vectors.append(table(ids[:, j]))
            stacked = torch.stack(vectors, dim=1)  # B x 27 x d
            products = torch.bmm(stacked, stacked.transpose(1, 2))  # B x 27 x 27
            pairs = products[:, self.tril_rows, self.tril_cols]  # B x 351
            return self.top(torch.cat([bottom, pairs], dim=1))  # B x 1

        def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            return torch.sigmoid(self.logits(dense, ids))

    torch.manual_seed(config.seed)
    return DLRM()


def train(config: DLRMConfig, train_data: tuple[np.ndarray, np.ndarray, np.ndarray],
          valid_data: tuple[np.ndarray, np.ndarray, np.ndarray], device: str = "cpu",
          log: Callable[[str], None] = print):
    """Train on whole in-memory tensors; keep the epoch with the best validation log loss.

    Args:
        train_data, valid_data: (dense [B x 13] f32, ids [B x 26] i64, labels [B]).
        device: "cpu" or "gpu" (mixed precision + TF32 only on GPU).
    """
    import torch

    use_gpu = device == "gpu"
    dev = torch.device("cuda" if use_gpu else "cpu")
    if use_gpu:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    model = build(config).to(dev)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.learning_rate)
    scaler = torch.amp.GradScaler("cuda", enabled=use_gpu)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    dense, ids, labels = (torch.as_tensor(a).to(dev) for a in train_data)
    labels = labels.float().reshape(-1, 1)
    rng = np.random.default_rng(config.seed)
    best_loss, best_state = float("inf"), None
    for epoch in range(config.epochs):
        model.train()
        for idx in minibatches(len(labels), config.batch_size, rng):
            index = torch.as_tensor(idx, device=dev)
            with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=use_gpu):
                loss = loss_fn(model.logits(dense[index], ids[index]), labels[index])
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        scores = predict(model, valid_data[0], valid_data[1], dev)
        val_loss = metrics.log_loss(valid_data[2], scores)
        log(f"  dlrm_torch epoch {epoch + 1}: valid logloss {val_loss:.4f} "
            f"auc {metrics.auc(valid_data[2], scores):.4f}")
        if val_loss < best_loss:
            best_loss = val_loss
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.load_state_dict(best_state)
    return model.cpu().eval()


def predict(model, dense: np.ndarray, ids: np.ndarray, dev=None, batch: int = 65536) -> np.ndarray:
    import torch

    model.eval()
    out = []
    with torch.inference_mode():
        for start in range(0, len(dense), batch):
            d = torch.as_tensor(dense[start:start + batch], device=dev)
            i = torch.as_tensor(ids[start:start + batch], device=dev)
            out.append(model(d, i).float().cpu().numpy())
    return np.concatenate(out).reshape(-1)


def save(model, out_dir: str | Path) -> Path:
    """Script the model and save TorchScript (what libtorch and Triton's pytorch backend load)."""
    import torch

    path = Path(out_dir) / MODEL_FILE
    torch.jit.script(model.cpu().eval()).save(str(path))
    return path


class TorchScorer:
    """Loads ``model.pt``; ``(dense_features, category_ids) -> [B x 1] float32``.

    ``device="gpu"`` loads the module onto CUDA and copies each batch there and back.
    """

    def __init__(self, model_dir: str | Path, threads: int = 1, device: str = "cpu"):
        import torch

        torch.set_num_threads(threads)
        self._torch = torch
        self._device = torch.device("cuda" if device == "gpu" else "cpu")
        self.model = torch.jit.load(str(Path(model_dir) / MODEL_FILE), map_location=self._device).eval()

    def __call__(self, dense_features: np.ndarray, category_ids: np.ndarray) -> np.ndarray:
        torch = self._torch
        with torch.inference_mode():
            out = self.model(torch.from_numpy(np.ascontiguousarray(dense_features)).to(self._device),
                             torch.from_numpy(np.ascontiguousarray(category_ids)).to(self._device))
        return out.float().cpu().numpy().reshape(-1, 1)
