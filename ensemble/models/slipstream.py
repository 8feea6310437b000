"""Slipstream: train the PyTorch DLRM while skipping inputs whose embeddings have gone stale.

After the seed (``slipstream-readme.txt``, "Towards Embedding Variation Aware Recommender Model
Training"), in three parts:

1. **Hot/cold split** (:func:`split_hot_cold`): one pass over the batch source counts how often
   each row of the stacked embedding table is looked up; rows looked up by at least a share Λ of
   the training inputs are *hot*, the rest *cold*. Only hot rows are tracked: frequently updated
   embeddings are the ones that saturate, and tracking them is cheap (few rows).
2. **Stale tracking** (:class:`StaleTracker`): every ``window`` optimizer steps the hot rows are
   compared with a snapshot taken one window earlier; a hot row whose embedding moved less than a
   threshold T (L2 norm of the change) over the window is *stale*. Cold rows are never stale.
3. **Skip rule**: an input is skipped when at least a share α of its 26 lookups are stale rows.
   T is not a setting: at each window it is chosen on a sample of the incoming inputs so that a
   share D of them would be skipped (the seed: "T found automatically based on the target drop
   percentage D"). Kept inputs are packed into full batches, so skipping saves whole optimizer
   steps (on this CPU a step's cost is dominated by the dense Adam update of the whole table).

The seed names Λ, T, D and α but gives no formulas; the choices above (share-of-inputs Λ, L2
change over one window, α as a share of lookups, T as the sample quantile reaching D) are ours.
The hot/cold *placement* of the seed's FAE baseline (hot rows in GPU memory) buys nothing on a
CPU, so the model keeps its one stacked table and stays a plain :class:`dlrm_torch.DLRM`
(``dlrm_torch.save`` exports it unchanged).

Shapes: N = training inputs, V = rows of the stacked table (sum of cardinalities), F = 26, B = batch.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from ensemble import schema
from ensemble.data.shards import Batch, BatchSource, in_order
from ensemble.base.device import Device
from ensemble.models.dlrm import DLRMConfig, as_source, table_offsets


@dataclass(frozen=True)
class SlipstreamConfig:
    """Slipstream's settings (names from the seed where it names them).

    Attributes:
        hot_share: Λ. A table row is hot when at least this share of the training inputs look it
            up (count >= Λ x N). The seed picks Λ from the memory available for hot rows.
        drop_share: D, the target share of inputs skipped once skipping has started.
        alpha: α, an input is skipped when at least ceil(α x 26) of its lookups are stale rows
            (1.0: every lookup must be stale).
        window: optimizer steps between snapshots; staleness is the change over one window.
        warmup_steps: steps trained on every input before the first snapshot (embeddings move
            fast at first, so nothing is stale yet).
        sample_rows: incoming inputs on which T is chosen at each window.
    """

    hot_share: float = 1e-4
    drop_share: float = 0.3
    alpha: float = 0.8
    window: int = 50
    warmup_steps: int = 100
    sample_rows: int = 16384

    def __post_init__(self) -> None:
        if not 0 < self.hot_share <= 1:
            raise ValueError(f"hot_share (Λ) must be in (0, 1], got {self.hot_share}")
        if not 0 <= self.drop_share < 1:
            raise ValueError(f"drop_share (D) must be in [0, 1), got {self.drop_share}")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha (α) must be in (0, 1], got {self.alpha}")
        if self.window < 1 or self.warmup_steps < 0 or self.sample_rows < 1:
            raise ValueError("window and sample_rows must be >= 1, warmup_steps >= 0")

    @property
    def stale_lookups(self) -> int:
        """Stale lookups (of 26) that make an input skipped."""
        return max(1, math.ceil(self.alpha * schema.N_CATEGORICAL - 1e-9))


@dataclass(frozen=True)
class HotCold:
    """The hot/cold split of the stacked table.

    Attributes:
        counts: [V] int64, lookups of each row over one epoch.
        hot: [V] bool, counts >= Λ x inputs.
        inputs: N, the inputs counted.
        hot_input_share: share of inputs whose 26 lookups are all hot (the seed's "hot inputs").
    """

    counts: np.ndarray
    hot: np.ndarray
    inputs: int
    hot_input_share: float

    @property
    def hot_rows(self) -> int:
        return int(self.hot.sum())

    @property
    def hot_lookup_share(self) -> float:
        """Share of all lookups that hit a hot row."""
        return float(self.counts[self.hot].sum() / max(self.counts.sum(), 1))


def split_hot_cold(source: BatchSource, cardinalities: tuple[int, ...], hot_share: float) -> HotCold:
    """Count lookups per table row in one pass over ``source`` and split at Λ = ``hot_share``."""
    offsets = table_offsets(cardinalities)
    counts = np.zeros(sum(cardinalities), np.int64)
    inputs = 0
    source = in_order(source, 1 << 16)  # order does not matter to counts: read big unshuffled batches
    for _, ids, _ in source.epoch(0):
        counts += np.bincount((ids + offsets).ravel(), minlength=len(counts))
        inputs += len(ids)
    hot = counts >= hot_share * inputs
    all_hot = 0
    for _, ids, _ in source.epoch(0):  # second pass: needs the split; reads ids only
        all_hot += int(hot[ids + offsets].all(axis=1).sum())
    return HotCold(counts, hot, inputs, all_hot / max(inputs, 1))


class StaleTracker:
    """Snapshots of the hot rows, the stale mask, and the skip rule.

    Args:
        hot: [V] bool from :func:`split_hot_cold`.
        cardinalities: the table's columns (for the id offsets).
        config: Λ/D/α and the sample size.
    """

    def __init__(self, hot: np.ndarray, cardinalities: tuple[int, ...], config: SlipstreamConfig) -> None:
        self.offsets = table_offsets(cardinalities)
        self.hot_rows = np.flatnonzero(hot)
        self.config = config
        self.stale = np.zeros(len(hot), bool)  # [V]; nothing is stale before the first window closes
        self.threshold = math.nan  # T of the last window
        self.thresholds: list[float] = []
        self.seconds = 0.0  # spent measuring changes, choosing T and applying the rule
        self._snapshot = None  # [H x D] torch tensor

    @property
    def has_snapshot(self) -> bool:
        return self._snapshot is not None

    @property
    def active(self) -> bool:
        """Whether a window has closed (so skipping can happen)."""
        return not math.isnan(self.threshold)

    def change(self, weight) -> np.ndarray:
        """[V] float32: L2 change of each hot row since the snapshot (+inf for cold rows)."""
        import torch

        out = np.full(len(self.stale), np.inf, np.float32)
        with torch.no_grad():
            rows = torch.from_numpy(self.hot_rows)
            out[self.hot_rows] = (weight.index_select(0, rows).float().cpu() - self._snapshot).norm(dim=1).numpy()
        return out

    def snapshot(self, weight) -> None:
        """Remember the hot rows' current values (the start of a window)."""
        import torch

        with torch.no_grad():
            self._snapshot = weight.index_select(0, torch.from_numpy(self.hot_rows)).float().cpu().clone()

    def close_window(self, weight, sample_ids: np.ndarray) -> float:
        """End a window: measure each hot row's change, choose T on ``sample_ids`` [S x 26] so that a
        share D of them would be skipped, mark rows stale (change < T), and snapshot again.

        Returns:
            T (0.0 when the sample holds no input with enough hot lookups: nothing is skipped).
        """
        start = time.perf_counter()
        change = self.change(weight)
        self.threshold = choose_threshold(change[sample_ids + self.offsets], self.config.stale_lookups,
                                          self.config.drop_share)
        self.thresholds.append(self.threshold)
        self.stale = change < self.threshold
        self.snapshot(weight)
        self.seconds += time.perf_counter() - start
        return self.threshold

    def skip(self, ids: np.ndarray) -> np.ndarray:
        """[B] bool: inputs with at least ceil(α x 26) stale lookups (ids [B x 26], per-column ids)."""
        if not self.active:
            return np.zeros(len(ids), bool)
        start = time.perf_counter()
        skipped = self.stale[ids + self.offsets].sum(axis=1) >= self.config.stale_lookups
        self.seconds += time.perf_counter() - start
        return skipped


def choose_threshold(lookup_change: np.ndarray, stale_lookups: int, drop_share: float) -> float:
    """T such that a share ``drop_share`` of the sampled inputs have ``stale_lookups`` lookups
    whose change is below T.

    Args:
        lookup_change: [S x 26] change of the row each sampled input looks up (+inf: cold).
    Returns:
        T; an input is skipped when its ``stale_lookups``-th smallest change is < T. When fewer
        than that share of inputs can be skipped at all, T lets every one that can be through.
    """
    if drop_share <= 0 or len(lookup_change) == 0:
        return 0.0
    kth = np.partition(lookup_change, stale_lookups - 1, axis=1)[:, stale_lookups - 1]
    kth.sort()
    want = min(int(round(drop_share * len(kth))), len(kth))
    if want == 0:
        return 0.0
    finite = kth[np.isfinite(kth)]
    if want > len(finite):  # not enough inputs with hot lookups: skip all that can be
        return float(np.nextafter(finite[-1], np.float32(np.inf))) if len(finite) else 0.0
    # The smallest value above the want-th input: exactly `want` inputs fall below it (ties aside).
    return float(kth[want]) if want < len(kth) else float(np.nextafter(kth[-1], np.float32(np.inf)))


@dataclass
class SlipstreamStats:
    """What Slipstream did (JSON-able via ``dataclasses.asdict``).

    Attributes:
        hot_rows, table_rows: hot rows and all rows of the table.
        hot_lookup_share: share of lookups hitting hot rows; hot_input_share: inputs all hot.
        rows_per_epoch, skipped_per_epoch, steps_per_epoch, seconds_per_epoch: per epoch.
        thresholds: T chosen at each window.
        split_seconds: the hot/cold counting pass; tracking_seconds: snapshots, T and the rule.
    """

    hot_rows: int
    table_rows: int
    hot_lookup_share: float
    hot_input_share: float
    split_seconds: float
    rows_per_epoch: list[int] = field(default_factory=list)
    skipped_per_epoch: list[int] = field(default_factory=list)
    steps_per_epoch: list[int] = field(default_factory=list)
    seconds_per_epoch: list[float] = field(default_factory=list)
    thresholds: list[float] = field(default_factory=list)
    tracking_seconds: float = 0.0

    @property
    def skipped_share(self) -> float:
        return sum(self.skipped_per_epoch) / max(sum(self.rows_per_epoch), 1)


def kept_batches(batches: Iterator[Batch], tracker: StaleTracker, batch_size: int, counts: dict[str, int],
                 recent: list[np.ndarray]) -> Iterator[Batch]:
    """The inputs the skip rule keeps, packed into batches of ``batch_size`` (the last smaller).

    ``counts`` gains "rows" and "skipped"; ``recent`` holds the ids [b x 26] of incoming inputs
    (before skipping) since the last window, T's sample. The rule is applied as batches are
    pulled, so a window closed by the trainer applies to the next batch drawn.
    """
    parts: list[Batch] = []
    held = 0
    for dense, ids, labels in batches:
        recent.append(ids)
        keep = ~tracker.skip(ids)
        counts["rows"] += len(ids)
        counts["skipped"] += int(len(ids) - keep.sum())
        if not keep.all():
            dense, ids, labels = dense[keep], ids[keep], labels[keep]
        parts.append((dense, ids, labels))
        held += len(labels)
        while held >= batch_size:
            merged = tuple(np.concatenate([p[i] for p in parts]) for i in range(3)) if len(parts) > 1 else parts[0]
            yield merged[0][:batch_size], merged[1][:batch_size], merged[2][:batch_size]
            parts = [(merged[0][batch_size:], merged[1][batch_size:], merged[2][batch_size:])]
            held -= batch_size
    if held:
        yield tuple(np.concatenate([p[i] for p in parts]) for i in range(3))  # type: ignore[misc]


def train(config: DLRMConfig, slip: SlipstreamConfig, source, valid_data, device: Device = Device.CPU,
          log: Callable[[str], None] = print, tracker_class: type[StaleTracker] | None = None):
    """Train :class:`dlrm_torch.DLRM` with Slipstream; keep the epoch with the best validation log loss.

    Args:
        config: the DLRM (``cardinalities`` set) and its training settings, as for ``dlrm_torch.train``.
        slip: Slipstream's settings.
        source: batch source (``epoch(i)`` -> (dense [B x 13] f32, ids [B x 26] i64, labels [B] i8),
            every row once per epoch) or in-memory (dense, ids, labels).
        valid_data: the same, read in order after each epoch.
        device: CPU; the GPU path (mixed precision) is written as in ``dlrm_torch`` but not run here.
        tracker_class: a :class:`StaleTracker` subclass with another skip rule (the benchmark's
            random-skip control); None: Slipstream's.

    Returns:
        (the trained model on CPU in eval mode, :class:`SlipstreamStats`).
    """
    from ensemble.models import dlrm_torch

    source = as_source(source, config.batch_size, config.seed)
    valid_source = as_source(valid_data, 65536, shuffle=False)
    start = time.perf_counter()
    split = split_hot_cold(source, config.cardinalities, slip.hot_share)
    stats = SlipstreamStats(split.hot_rows, len(split.hot), split.hot_lookup_share, split.hot_input_share,
                            time.perf_counter() - start)
    log(f"  slipstream: {split.hot_rows} hot rows of {len(split.hot)} (Λ={slip.hot_share}), "
        f"{split.hot_lookup_share:.1%} of lookups, {split.hot_input_share:.1%} of inputs all hot "
        f"({stats.split_seconds:.1f}s)")
    tracker = (tracker_class or StaleTracker)(split.hot, config.cardinalities, slip)
    fit = dlrm_torch.Fit(config, device)
    weight = fit.model.sparse_arch.table.weight
    step, window_start = 0, 0
    recent: list[np.ndarray] = []
    for epoch in range(config.epochs):
        fit.model.train()
        counts = {"rows": 0, "skipped": 0}
        epoch_start, epoch_steps = time.perf_counter(), 0
        for batch in kept_batches(source.epoch(epoch), tracker, config.batch_size, counts, recent):
            fit.step(*batch)
            step, epoch_steps = step + 1, epoch_steps + 1
            if not tracker.has_snapshot:
                if step >= slip.warmup_steps:  # warm-up over: the first window starts here
                    tracker.snapshot(weight)
                    window_start = step
                    recent.clear()
            elif step - window_start >= slip.window:
                tracker.close_window(weight, np.concatenate(recent)[-slip.sample_rows:])
                window_start = step
                recent.clear()
            elif len(recent) > 1 and sum(len(r) for r in recent) > 2 * slip.sample_rows:
                recent.pop(0)  # bound T's sample buffer within a window
        stats.rows_per_epoch.append(counts["rows"])
        stats.skipped_per_epoch.append(counts["skipped"])
        stats.steps_per_epoch.append(epoch_steps)
        stats.seconds_per_epoch.append(time.perf_counter() - epoch_start)
        val_loss, val_auc = fit.validate(valid_source)
        log(f"  dlrm_torch+slipstream epoch {epoch + 1}: skipped {counts['skipped']} of {counts['rows']} "
            f"({counts['skipped'] / max(counts['rows'], 1):.1%}), {epoch_steps} steps; valid logloss "
            f"{val_loss:.4f} auc {val_auc:.4f}")
    stats.thresholds, stats.tracking_seconds = tracker.thresholds, tracker.seconds
    return fit.best(), stats
