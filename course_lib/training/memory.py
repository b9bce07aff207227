"""Memory per rank, measured: a census of the tensors that hold parameters, gradients and optimizer state.

The Ultra-Scale Playbook (Hugging Face, 2025) counts the memory of training as the model's *states*:
parameters, gradients and optimizer state, Psi parameters of each. In the course's precision (float32
everywhere, 4 bytes a number) with Adam (exp_avg and exp_avg_sq, 2 numbers per parameter), per rank:

    stage                   parameters     gradients     optimizer state    total
    plain data parallelism  4 Psi          4 Psi         8 Psi              16 Psi
    ZeRO-1                  4 Psi          4 Psi         8 Psi / G          8 Psi + 8 Psi / G
    ZeRO-2                  4 Psi          4 Psi / G     8 Psi / G          4 Psi + 12 Psi / G
    ZeRO-3                  4 Psi / G      4 Psi / G     8 Psi / G          16 Psi / G

(The Playbook's own table is for mixed precision: bf16 parameters and gradients, 2 bytes each, and
k = 12 bytes of optimizer state per parameter (an fp32 master copy and Adam's two moments):
2 Psi + 2 Psi + k Psi, each term divided by G where the stage shards it. `model_state_bytes` knows
both.) Activations are left out, as in the Playbook's ZeRO table: they depend on the batch, not on
the stage.

That is what each rank *keeps*, and holds when the optimizer steps. During a step a sharded rank also
holds, for a moment, what it is working on: in ZeRO-2 and ZeRO-3 the full gradient of the layer being
reduce-scattered, in ZeRO-3 the full parameters of the layer being computed (two layers with
prefetch). `schedule_bytes` follows `zero_sharded`'s schedule element by element, padding included,
and gives both figures; the census measures both.

`MemoryCensus` measures instead of computing: at every point of a step where the trainer allocates
or frees something (before and after every collective, around every layer's forward and backward,
after the optimizer step) it counts the bytes of every distinct storage behind the tensors the model,
the optimizer and the trainer hold, sorted into the three kinds. A storage shared by several tensors
(a parameter that is a view into a flat buffer) counts once; a storage freed to 0 bytes counts 0.
Its peaks are the figures to hold against the formulas::

    census = MemoryCensus()
    sharded = zero_sharded.ShardedDataParallel(model, torch.optim.Adam, stage=3, census=census, lr=1e-3)
    training.train_data_parallel(model, sharded, data, loss_fn, batch_size=16, max_steps=3)
    census.peak                       # {'params': ..., 'grads': ..., 'optimizer': ..., 'total': ...} in bytes
    census.at("after optimizer step")  # the last count taken there: what the formula describes
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = ["KINDS", "MemoryCensus", "CensusSample", "storage_bytes", "optimizer_tensors", "model_state_bytes",
           "schedule_bytes", "PRECISIONS"]

KINDS = ("params", "grads", "optimizer")

# Bytes per parameter of each model state, per precision: (parameters, gradients, optimizer state).
PRECISIONS = {
    "fp32": (4, 4, 8),        # the course: float32 everywhere, Adam's two moments
    "mixed": (2, 2, 12),      # the Playbook's: bf16 parameters and gradients; fp32 master copy + Adam's moments
}


@dataclass(frozen=True)
class CensusSample:
    """One count: where in the step it was taken, and the bytes of each kind held at that moment."""

    where: str
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def _storages(tensors):
    """(key, nbytes) of every distinct storage behind `tensors` (None entries skipped)."""
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes:
            yield (storage.data_ptr(), str(t.device)), nbytes


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a view and its base count once)."""
    return sum(dict(_storages(tensors)).values())


def optimizer_tensors(optimizer):
    """Every tensor an optimizer keeps as state (exp_avg, exp_avg_sq, step counts, momentum buffers ...)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return [value for state in inner.state.values() for value in state.values() if isinstance(value, torch.Tensor)]


@dataclass
class MemoryCensus:
    """Counts of parameter, gradient and optimizer-state bytes at many points of a step, and their peaks.

    Attributes:
        samples: every `CensusSample`, in the order taken (``record=True``; else only the peaks).
        peak: the largest count of each kind, and of their sum at one moment ('total'), in bytes.
        steady: the counts of the last sample taken between steps (`between_steps`), in bytes.
    """

    record: bool = True
    samples: list = field(default_factory=list)
    peak: dict = field(default_factory=lambda: {kind: 0 for kind in (*KINDS, "total")})
    steady: dict = field(default_factory=dict)

    def count(self, where: str, params=(), grads=(), optimizer=()) -> CensusSample:
        """Count now. Each argument is an iterable of tensors (None allowed); a storage is counted in the
        first kind that names it (parameters, then gradients, then optimizer state)."""
        seen: set = set()
        totals = []
        for tensors in (params, grads, optimizer):
            total = 0
            for key, nbytes in _storages(tensors):
                if key not in seen:
                    seen.add(key)
                    total += nbytes
            totals.append(total)
        sample = CensusSample(where, *totals)
        for kind, value in zip(KINDS, totals):
            self.peak[kind] = max(self.peak[kind], value)
        self.peak["total"] = max(self.peak["total"], sample.total)
        if self.record:
            self.samples.append(sample)
        return sample

    def at(self, where: str) -> CensusSample:
        """The last sample taken at `where` (needs ``record=True``)."""
        for sample in reversed(self.samples):
            if sample.where == where:
                return sample
        raise KeyError(f"no census sample taken at {where!r}; taken at: {sorted({s.where for s in self.samples})}")

    def between_steps(self, sample: CensusSample) -> None:
        """Remember `sample` as what the rank keeps from one step to the next."""
        self.steady = {"params": sample.params, "grads": sample.grads, "optimizer": sample.optimizer,
                       "total": sample.total}

    def reset(self) -> None:
        """Forget every count (e.g. after a warm-up step that created the optimizer state)."""
        self.samples.clear()
        self.peak = {kind: 0 for kind in (*KINDS, "total")}
        self.steady = {}


def model_state_bytes(numel: int, world_size: int, stage: int, precision: str = "fp32") -> dict:
    """The Playbook's formula: bytes per rank of parameters, gradients and optimizer state.

    Args:
        numel: Psi, the number of parameters.
        world_size: G, the ranks the states are sharded over.
        stage: 0 (plain data parallelism), 1, 2 or 3 (ZeRO stage).
        precision: 'fp32' (the course's: 4 + 4 + 8 bytes per parameter) or 'mixed' (the Playbook's
            table: 2 + 2 + 12).

    Returns:
        {'params', 'grads', 'optimizer', 'total'}: params = b_p Psi / (G if stage 3), grads = b_g Psi /
        (G if stage >= 2), optimizer = b_o Psi / (G if stage >= 1), in bytes (floats: Psi / G need not be whole).

    Example::

        >>> model_state_bytes(7e9, 64, 3)["total"] / 1e9     # 7B parameters, fp32 Adam, ZeRO-3 on 64 ranks
        1.75
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0 (plain data parallelism), 1, 2 or 3, got {stage!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    b_params, b_grads, b_optimizer = PRECISIONS[precision]
    out = {"params": b_params * numel / (world_size if stage >= 3 else 1),
           "grads": b_grads * numel / (world_size if stage >= 2 else 1),
           "optimizer": b_optimizer * numel / (world_size if stage >= 1 else 1)}
    out["total"] = sum(out.values())
    return out


def schedule_bytes(unit_numels, world_size: int, stage: int, rank: int = 0, prefetch: bool = False,
                   params_per_unit=None, element_size: int = 4) -> dict:
    """What `zero_sharded.ShardedDataParallel` holds on rank `rank`, exactly, with Adam in float32.

    The Playbook's formula (`model_state_bytes`) counts what a stage keeps. This follows the
    schedule element by element: each layer of n elements padded to G P, P = ceil(n / G); rank r
    owning elements [r P, (r+1) P) of it (fewer, or none, at the end); a layer's full gradient alive
    from the start of its backward until its reduce-scatter; in stage 3 a layer's parameters alive
    from its all-gather until its forward ends (or its gradient is reduce-scattered), the next layer's
    too with prefetch. Layers' backward runs last layer first.

    Args:
        unit_numels: n of every layer (module owning parameters), forward order.
        world_size, stage, rank, prefetch: as in `ShardedDataParallel`.
        params_per_unit: how many parameter tensors each layer has (Adam keeps a step counter per
            tensor it steps); default 2 (weight and bias).

    Returns:
        {'at_step': {...}, 'peak': {...}}, each {'params', 'grads', 'optimizer'} in bytes: what the rank
        holds when the optimizer steps, and the most it holds at any moment of the step.
    """
    g = world_size
    sizes = [int(n) for n in unit_numels]
    tensors = list(params_per_unit) if params_per_unit is not None else [2] * len(sizes)
    pieces = [math.ceil(n / g) if stage else n for n in sizes]
    real = [max(0, min(p, n - rank * p)) if stage else n for n, p in zip(sizes, pieces)]
    padded = [g * p if stage else p for p in pieces]
    steps_counters = 4 * (sum(tensors) if stage == 0 else len(sizes))   # Adam's step: one float32 per tensor stepped
    optimizer = 2 * element_size * sum(real) + steps_counters
    if stage == 0:
        params = grads = sum(sizes)
        peak_params = peak_grads = params
    elif stage in (1, 2):
        params = peak_params = sum(padded)
        grads = sum(padded) if stage == 1 else sum(pieces)
        peak_grads = grads if stage == 1 else max(
            sum(pieces[u + 1:]) + padded[u] + pieces[u] for u in range(len(sizes)))
    else:
        params = sum(pieces)
        if prefetch:
            gathered = max(padded[u] + (padded[u + 1] if u + 1 < len(sizes) else 0) for u in range(len(sizes)))
        else:
            gathered = max(padded)
        peak_params = params + gathered
        grads = sum(pieces)
        peak_grads = max(sum(pieces[u + 1:]) + padded[u] + pieces[u] for u in range(len(sizes)))
    at_step = {"params": element_size * params, "grads": element_size * grads, "optimizer": optimizer}
    peak = {"params": element_size * peak_params, "grads": element_size * peak_grads, "optimizer": optimizer}
    return {"at_step": at_step, "peak": peak}
