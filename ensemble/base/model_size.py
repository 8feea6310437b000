"""How large the models are: a named size, then a dataset spec's ``[model]`` table, then the
command line's explicit widths, each overriding the one before.

- ``demo``: what the project's demo trains (16-wide embeddings, 64-32 / 128-64 MLPs, up to 400 trees
  of depth 8): small enough to train in minutes on two cores.
- ``seed``: the DLRM reference configuration for Criteo (128-wide embeddings, bottom MLP
  512-256-128, top MLP 1024-1024-512-256-1) for both DLRMs, and up to 1,000 trees of depth 8: the
  size of the models people serve, to measure the server at.

A spec's table::

    [model]
    size = "seed"                 # optional: the preset the others change
    embedding_dim = 64
    bottom_mlp = [256, 128]       # hidden widths; the bottom MLP ends in embedding_dim
    top_mlp = [512, 256]          # hidden widths; the top MLP ends in one logit
    xgb_rounds = 600              # most boosting rounds (early stopping)
    xgb_depth = 6
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace


class SizeError(ValueError):
    """A size that cannot be trained; the message says which setting and why."""


@dataclass(frozen=True)
class ModelSize:
    """Both DLRMs' widths and the forest's bounds."""

    embedding_dim: int
    bottom_mlp: tuple[int, ...]
    top_mlp: tuple[int, ...]
    xgb_rounds: int
    xgb_depth: int

    def check(self, where: str = "model size") -> "ModelSize":
        for name in ("embedding_dim", "xgb_rounds", "xgb_depth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SizeError(f"{where}: {name} must be a positive integer, not {value!r}")
        for name in ("bottom_mlp", "top_mlp"):
            widths = getattr(self, name)
            if not isinstance(widths, tuple) or not all(isinstance(w, int) and not isinstance(w, bool) and w > 0
                                                        for w in widths):
                raise SizeError(f"{where}: {name} must be a list of positive widths, not {widths!r}")
        return self


SIZES = {
    "demo": ModelSize(embedding_dim=16, bottom_mlp=(64, 32), top_mlp=(128, 64), xgb_rounds=400, xgb_depth=8),
    "seed": ModelSize(embedding_dim=128, bottom_mlp=(512, 256), top_mlp=(1024, 1024, 512, 256), xgb_rounds=1000,
                      xgb_depth=8),
}
DEFAULT = "demo"
KEYS = {f.name for f in fields(ModelSize)}


def from_table(table: dict, where: str) -> dict:
    """The settings a spec's ``[model]`` table gives (``size`` included), checked."""
    if not isinstance(table, dict):
        raise SizeError(f"{where}: [model] must be a table")
    unknown = sorted(set(table) - KEYS - {"size"})
    if unknown:
        raise SizeError(f"{where}: [model]: unknown key(s) {', '.join(unknown)} (known: size, {', '.join(sorted(KEYS))})")
    if "size" in table and table["size"] not in SIZES:
        raise SizeError(f"{where}: [model]: size must be one of {', '.join(SIZES)}, not {table['size']!r}")
    settings = {k: tuple(v) if isinstance(v, list) else v for k, v in table.items()}
    replace(SIZES[settings.get("size", DEFAULT)], **{k: v for k, v in settings.items() if k != "size"}).check(where)
    return settings


def resolve(size: str | None, spec_settings: dict, explicit: dict) -> ModelSize:
    """The size to train: ``size`` (else the spec's, else the default), then the spec's settings,
    then ``explicit`` ones (None values: not given)."""
    name = size or spec_settings.get("size") or DEFAULT
    if name not in SIZES:
        raise SizeError(f"model size must be one of {', '.join(SIZES)}, not {name!r}")
    chosen = replace(SIZES[name], **{k: v for k, v in spec_settings.items() if k != "size"})
    return replace(chosen, **{k: v for k, v in explicit.items() if v is not None}).check()


def widths(text: str) -> tuple[int, ...]:
    """``"512,256"`` -> (512, 256) (a command-line list of hidden widths)."""
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise SizeError(f"not a comma-separated list of widths: {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise SizeError(f"widths must be positive integers: {text!r}")
    return values
