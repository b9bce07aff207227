"""ZeRO stages 0 to 3, layer by layer: what each rank keeps of the parameters, gradients and optimizer state.

`zero.ShardedOptimizer` (notebook 11) is ZeRO-1 on one flat vector. Here the same idea goes all the
way, one *layer* at a time, as DeepSpeed and PyTorch's FSDP do it. A layer (a unit) is every module
that owns parameters directly (a Linear, a Conv2d, a BatchNorm); its parameters are laid out in one
flat buffer, padded to G * P elements, P = ceil(n / G), so that it cuts into G equal pieces: rank r
owns elements [r P, (r+1) P) of every layer. Every stage computes the same step as plain data
parallelism; what differs is what a rank keeps between steps and what it sends:

    stage 0  plain data parallelism: full parameters, full gradients, full optimizer state. During
             backward, each layer's gradient is all-reduced as soon as it is complete (in place: the
             parameters' .grad are views into the layer's flat gradient buffer, as DDP's
             gradient_as_bucket_view), then the optimizer steps everything on every rank.
    stage 1  ZeRO-1: each layer's gradient is reduce-scattered instead: rank r receives the summed
             gradient of its piece only, steps its piece with Adam (whose state exists for 1/G of
             the parameters), and all-gathers the updated pieces after the step. The full local
             gradients stay allocated (DeepSpeed's stage 1 keeps them too).
    stage 2  ZeRO-2: the same messages, but each layer's full gradient is freed as soon as its piece
             is reduced: between the layers' reduce-scatters a rank holds its pieces (1/G) and the
             one layer in flight.
    stage 3  ZeRO-3 (FSDP): the parameters are sharded too. Between steps rank r keeps piece r of
             every layer and nothing else. Just before a layer's forward its pieces are all-gathered
             into the layer's flat buffer (the module's parameters are views into it), and freed
             right after; again just before its backward (autograd saved views of them), and freed
             once its gradient is reduce-scattered. The optimizer steps the pieces; no all-gather
             after the step. With ``prefetch=True`` the next layer's all-gather starts (on the rank's
             async thread, `collectives.all_gather(async_op=True)`) while the current layer computes.

Messages per step, per rank, for a layer of n elements, P = ceil(n / G) (ring all-reduce in stage 0;
course_lib's reduce_scatter and ring all_gather otherwise):

    stage 0    all-reduce of n                        ~ 2 (G-1) n / G
    stage 1-2  reduce-scatter + all-gather of P       (G-1) P + (G-1) P
    stage 3    all-gather (forward) + all-gather (backward) + reduce-scatter   3 (G-1) P

plus, every stage, one all-reduce of two numbers (the loss sum and the sample count of the global
batch) before backward. ZeRO-3 sends 1.5x what plain data parallelism sends, for parameters stored
G times fewer.

Float results: the gradient of every element is summed over the ranks in rank order 0..G-1 by the
reduce-scatter, exactly as the 'naive' all-reduce sums, so stages 1-3 give bit for bit the parameters
of `train_data_parallel(..., allreduce="naive")` with the same optimizer (one that updates every
element on its own: Adam, SGD with momentum, weight decay; see `zero`), and stage 0 too with
``allreduce="naive"``. Against the ring the sums differ by rounding.

Use it in place of the optimizer, with the model it wraps::

    sharded = ShardedDataParallel(model, torch.optim.Adam, stage=3, prefetch=True, lr=1e-3)
    log = training.train_data_parallel(model, sharded, data, F.cross_entropy, batch_size=16)

Limits, on purpose: every parameter trains (requires_grad) and every layer runs in every forward
(FSDP's default asks the same); a layer runs once per forward (no weight sharing between calls); one
dtype and device for all parameters; the ranks run the same model, so their hooks fire in the same
order and their collectives match.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from course_lib import collectives, runtime
from course_lib import allreduce as allreduce_variants
from course_lib.training.memory import MemoryCensus, optimizer_tensors

__all__ = ["ShardedDataParallel", "Unit", "StepEvent", "expected_bytes_sent", "STAGES"]

STAGES = {0: "plain data parallelism", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


@dataclass
class StepEvent:
    """Something the rank did in a step, on its compute thread, in seconds after the step began.

    kind: 'forward' / 'backward' (a layer's compute), 'gather' (waiting for a layer's parameters:
    the whole all-gather, or only what was left of a prefetched one), 'reduce' (a layer's gradient
    all-reduce or reduce-scatter), 'step' (optimizer step and, stages 1-2, the all-gathers after it).
    """

    kind: str
    unit: int
    start: float
    end: float


@dataclass
class Unit:
    """One layer's share of the bookkeeping (a module that owns parameters directly).

    Attributes:
        index: position among the units, in the order of ``model.modules()`` (the forward order).
        name: the module's qualified name.
        params: its parameters, in ``module.parameters(recurse=False)`` order.
        numel: n, their elements together.
        piece: P = ceil(n / G): what each rank owns of the padded flat buffer.
        mine: (start, stop) of this rank's real elements (the padding excluded; may be empty).
        flat: the layer's flat parameter buffer (G P elements; stage 0: n). Its storage is freed
            between uses in stage 3.
        shard: this rank's piece as the optimizer sees it (an nn.Parameter of mine[1] - mine[0]
            elements): a view into `flat` in stages 1-2, into `store` in stage 3; None in stage 0.
        store: stage 3: the P elements this rank keeps between steps.
        grad: the layer's flat gradient buffer (the parameters' .grad are views into it), or None
            while it is not allocated (stages 2-3 between their reduce-scatters).
    """

    index: int
    name: str
    module: nn.Module
    params: list
    numel: int
    piece: int
    mine: tuple
    flat: torch.Tensor | None = None
    shard: nn.Parameter | None = None
    store: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    offsets: list = field(default_factory=list)
    pending: int = 0
    gathered: bool = False
    work: object = None         # the Work of a prefetched all-gather in flight
    forward_done: bool = False
    backward_started: bool = False
    reduced: bool = False
    t_start: float = 0.0        # when its forward or backward began (for the events)


class ShardedDataParallel:
    """Plain data parallelism (stage 0) or ZeRO-1, -2, -3, layer by layer, from course_lib's collectives.

    Create it on every rank after `course_lib.launch` started the group, with the model and the
    optimizer's class; pass it as the optimizer of `training.train_data_parallel` (with the same
    model), or drive it yourself (see `start_step`).

    Args:
        model: this rank's replica. Rank 0's parameters and buffers are broadcast first (as DDP's
            constructor does); then each layer's parameters are moved into its flat buffer.
        optimizer_class: e.g. ``torch.optim.Adam``; it steps this rank's pieces (stage 0: everything).
        stage: 0, 1, 2 or 3 (see the module docstring).
        prefetch: stage 3 only: start the next layer's all-gather while this one computes.
        allreduce: stage 0's gradient all-reduce, a `course_lib.allreduce` name ('ring', 'naive', ...).
        census: a `memory.MemoryCensus` to count the rank's parameter, gradient and optimizer bytes at
            every point of a step where they change.
        record_events: keep, per step, when each layer computed, waited for its parameters and reduced
            its gradient (`events`, for a timeline).
        **defaults: the optimizer's arguments (lr, betas, weight_decay ...).

    Attributes:
        units: one `Unit` per layer, in forward order.
        optimizer: the inner optimizer (over the pieces; stage 0: over the model's parameters).
        events: per step, the `StepEvent`s of this rank (``record_events=True``).

    Example::

        >>> def fn(rank, world_size):
        ...     model = toy.make_mlp(hidden=31, seed=rank)
        ...     sharded = ShardedDataParallel(model, torch.optim.Adam, stage=3, lr=0.01)
        ...     log = training.train_data_parallel(model, sharded, data, F.cross_entropy, batch_size=8)
        ...     return sharded.full_parameters()          # all-gathered: the same on every rank
    """

    layered = True   # train_data_parallel drives objects with this flag through start_step / finish_gradients

    def __init__(self, model: nn.Module, optimizer_class, *, stage: int = 3, prefetch: bool = False,
                 allreduce: str = "ring", census: MemoryCensus | None = None, record_events: bool = False,
                 **defaults):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("ShardedDataParallel shards the model over the ranks of a process group: create it "
                               "inside a function started by course_lib.launch (or under torchrun).")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError("optimizer_class must be a torch.optim.Optimizer class such as torch.optim.Adam "
                            f"(the class, not an instance), got {optimizer_class!r}")
        if isinstance(stage, bool) or stage not in STAGES:
            raise ValueError(f"stage must be 0 (plain data parallelism), 1, 2 or 3 (ZeRO stage), got {stage!r}")
        if not isinstance(prefetch, bool):
            raise TypeError(f"prefetch must be True or False, got {prefetch!r}")
        if prefetch and stage != 3:
            raise ValueError(f"prefetch=True starts the next layer's parameter all-gather early, which only stage 3 "
                             f"does (stage {stage} keeps full parameters); leave prefetch out or use stage=3.")
        if allreduce not in allreduce_variants.VARIANTS:
            raise ValueError(f"allreduce must name a course_lib.allreduce variant ({sorted(allreduce_variants.VARIANTS)}), "
                             f"got {allreduce!r}")
        self.model, self.stage, self.prefetch = model, stage, prefetch
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.census, self.record_events = census, record_events
        self._allreduce = allreduce_variants.get(allreduce)
        self._allreduce_name = allreduce
        problem = _check_model(model)
        units = _units(model) if problem is None else []
        plan = ",".join(str(u[2]) for u in units) + f"|{allreduce}"
        runtime.agree("ShardedDataParallel",
                      {"stage": stage, "prefetch": int(prefetch), "layers": len(units), "plan": runtime.name_code(plan)},
                      same=("stage", "prefetch", "layers", "plan"), problem=problem,
                      describe={"plan": lambda code: f"layer sizes and all-reduce #{code}"})
        from course_lib.training.data_parallel import broadcast_parameters   # one layer up: imported when used
        broadcast_parameters(model)                               # every rank starts from rank 0's model
        self.units = [self._make_unit(i, name, module) for i, (name, module, _) in enumerate(units)]
        if stage == 0:
            self.optimizer = optimizer_class([p for u in self.units for p in u.params], **defaults)
        else:
            self.optimizer = optimizer_class([u.shard for u in self.units], **defaults)
        self._handles = []
        for unit in self.units:
            for p in unit.params:
                self._handles.append(p.register_post_accumulate_grad_hook(
                    lambda param, unit=unit: self._on_grad(unit)))
            if stage == 3:
                self._handles.append(unit.module.register_forward_pre_hook(
                    lambda module, args, unit=unit: self._before_forward(unit)))
            if stage >= 2:
                self._handles.append(unit.module.register_forward_hook(
                    lambda module, args, output, unit=unit: self._after_forward(unit, output)))
        self.events: list = []
        self._calls: list = []
        self._in_flight: list = []
        self._in_step = False
        self._step_count = 0
        self.total, self.global_loss = 1, 0.0
        self.zero_grad()
        self._count("after setup")

    # ------------------------------------------------------------------------------------- layout

    def _make_unit(self, index, name, module) -> Unit:
        params = list(module.parameters(recurse=False))
        numel = sum(p.numel() for p in params)
        g = self.world_size
        piece = math.ceil(numel / g) if self.stage else numel
        start = min(self.rank * piece, numel) if self.stage else 0
        stop = min(start + piece, numel) if self.stage else numel
        unit = Unit(index, name, module, params, numel, piece, (start, stop))
        first = params[0]
        length = g * piece if self.stage else numel
        flat = torch.zeros(length, dtype=first.dtype, device=first.device)
        offset = 0
        for p in params:
            unit.offsets.append(offset)
            flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            offset += p.numel()
        unit.flat = flat
        self._point_params_at(unit)
        if self.stage in (1, 2):
            unit.shard = nn.Parameter(flat[start:stop])                   # a view: no copy of the piece
        elif self.stage == 3:
            unit.store = flat[self.rank * piece:(self.rank + 1) * piece].clone()
            unit.shard = nn.Parameter(unit.store[:stop - start])
            self._free_params(unit)
        return unit

    def _point_params_at(self, unit: Unit) -> None:
        for p, offset in zip(unit.params, unit.offsets):
            p.data = unit.flat[offset:offset + p.numel()].view_as(p)

    def _grad_views(self, unit: Unit) -> None:
        """Make every parameter's .grad a view into the layer's gradient buffer (autograd adds into it)."""
        for p, offset in zip(unit.params, unit.offsets):
            p.grad = unit.grad[offset:offset + p.numel()].view_as(p)

    def _new_grad_buffer(self, unit: Unit) -> None:
        if unit.grad is None:
            unit.grad = torch.zeros(unit.flat.numel(), dtype=unit.flat.dtype, device=unit.flat.device)
            self._grad_views(unit)

    # ----------------------------------------------------------------------------- stage 3 gathers

    def _free_params(self, unit: Unit) -> None:
        unit.flat.untyped_storage().resize_(0)
        unit.gathered = False

    def _gather(self, unit: Unit, async_op: bool = False):
        """All-gather the layer's pieces into its flat buffer (re-allocated); returns the Work if async."""
        self._calls.append(("gather", unit.index))
        unit.flat.untyped_storage().resize_(unit.flat.numel() * unit.flat.element_size())
        unit.gathered = True
        pieces = list(unit.flat.split(unit.piece))
        with runtime.unchecked():                 # the layout was agreed on once, in __init__
            return collectives.all_gather(pieces, unit.store, async_op=async_op)

    def _ensure_gathered(self, unit: Unit) -> None:
        t0 = runtime.clock()
        if unit.work is not None:
            unit.work.wait()
            unit.work = None
        elif not unit.gathered:
            self._gather(unit)
        self._event("gather", unit, t0)
        self._count(f"layer {unit.index} gathered")

    def _prefetch(self, unit: Unit | None) -> None:
        if self.prefetch and unit is not None and not unit.gathered:
            unit.work = self._gather(unit, async_op=True)
            self._count(f"layer {unit.index} prefetch started")

    def _before_forward(self, unit: Unit) -> None:
        if not self._in_step:
            if not unit.gathered:
                raise RuntimeError("this model's parameters are sharded between steps (ZeRO-3): run its forward "
                                   "inside a training step (training.train_data_parallel, or begin_step() first), "
                                   "or copy full_parameters() into an unsharded model to evaluate it.")
            return
        if unit.forward_done:
            raise RuntimeError(f"layer {unit.index} ({unit.name}) ran twice in one forward: ShardedDataParallel "
                               "gathers each layer once per forward, so a layer must not be called twice (no "
                               "weight sharing between calls).")
        self._ensure_gathered(unit)
        unit.t_start = runtime.clock()
        self._prefetch(self.units[unit.index + 1] if unit.index + 1 < len(self.units) else None)

    def _after_forward(self, unit: Unit, output) -> None:
        if not self._in_step:
            return
        unit.forward_done = True
        self._forward_ran = True
        if self.stage == 3:
            self._event("forward", unit, unit.t_start)
            self._free_params(unit)
            self._count(f"layer {unit.index} forward done, freed")
        # Before the layer's backward: a hook on its output's gradient (FSDP registers the same).
        for tensor in _tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(lambda grad, unit=unit: self._before_backward(unit))

    def _before_backward(self, unit: Unit) -> None:
        if not self._in_step or unit.backward_started:
            return
        unit.backward_started = True
        self._backward_ran = True
        if self.stage == 3:
            self._ensure_gathered(unit)
            self._prefetch(self.units[unit.index - 1] if unit.index > 0 else None)
        self._new_grad_buffer(unit)
        unit.t_start = runtime.clock()
        self._count(f"layer {unit.index} backward starts")

    # ------------------------------------------------------------------------------- the gradients

    def _on_grad(self, unit: Unit) -> None:
        if not self._in_step:
            return
        unit.pending -= 1
        if unit.pending == 0:
            if unit.backward_started:
                self._event("backward", unit, unit.t_start)
            self._reduce_ready()

    def _reduce_ready(self) -> None:
        """Reduce every layer whose gradient is complete, last layer first, none out of order."""
        while self._next >= 0 and self.units[self._next].pending <= 0:
            self._reduce(self.units[self._next])
            self._next -= 1

    def _collect_grad(self, unit: Unit) -> torch.Tensor:
        """The layer's flat gradient buffer, with every parameter's gradient in place (zeros if none)."""
        self._new_grad_buffer(unit)
        for p, offset in zip(unit.params, unit.offsets):
            target = unit.grad[offset:offset + p.numel()]
            if p.grad is None:
                target.zero_()
            elif p.grad.data_ptr() != target.data_ptr():        # replaced (e.g. model.zero_grad()): copy
                target.copy_(p.grad.reshape(-1))
        return unit.grad

    def _reduce(self, unit: Unit) -> None:
        t0 = runtime.clock()
        self._calls.append(("reduce", unit.index))
        grad = self._collect_grad(unit)
        self._count(f"layer {unit.index} gradient ready")
        grad.mul_(self._local_count)                            # sum_r count_r grad_r / total: the global mean
        start, stop = unit.mine
        with runtime.unchecked():
            if self.stage == 0:
                self._allreduce(grad, "sum")
                grad.div_(self.total)
            elif self.stage == 1:
                # ZeRO-1 keeps the full gradient buffer: the reduced piece lands in its own place in it.
                pieces = list(grad.split(unit.piece))
                collectives.reduce_scatter(pieces[self.rank], pieces, op="sum")
                unit.shard.grad = pieces[self.rank][:stop - start].div_(self.total)
            else:
                mine = grad.new_empty(unit.piece)
                self._in_flight = [mine]                        # counted by the census while it is local
                collectives.reduce_scatter(mine, list(grad.split(unit.piece)), op="sum")
                self._count(f"layer {unit.index} reduce-scattered")
                self._in_flight = []
                for p in unit.params:                           # ZeRO-2: the full gradient goes at once
                    p.grad = None
                unit.grad = grad = None
                unit.shard.grad = mine[:stop - start].div_(self.total)
                del mine
        unit.reduced = True
        if self.stage == 3:
            self._free_params(unit)
        self._event("reduce", unit, t0)
        self._count(f"layer {unit.index} reduced")

    # ----------------------------------------------------------------------------- the step itself

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients: stages 0-1 zero the layers' gradient buffers (kept), stages 2-3 drop them."""
        for unit in self.units:
            if unit.shard is not None:
                unit.shard.grad = None
            if self.stage <= 1:
                if unit.grad is None:
                    unit.grad = torch.zeros(unit.flat.numel(), dtype=unit.flat.dtype, device=unit.flat.device)
                else:
                    unit.grad.zero_()
                self._grad_views(unit)
            else:
                for p in unit.params:
                    p.grad = None
                unit.grad = None

    def begin_step(self, count: int | None = None) -> None:
        """Call before the forward pass (the trainer does): arms the hooks for one step.

        Args:
            count: the samples this rank will train on in this step. Stage 3 needs it in its first
                step: a rank without samples repeats the order of all-gathers it made in an earlier
                step, so in the first one every rank must have samples (checked on every rank at once).
        """
        if self._in_step:
            raise RuntimeError("begin_step() called twice without step() in between")
        if self.stage == 3 and getattr(self, "_recorded", None) is None and count is not None:
            table = runtime.agree("ShardedDataParallel", {"samples": int(count > 0)})
            empty = [r for r, row in enumerate(table) if not row["samples"]]
            if empty:
                raise RuntimeError(f"rank(s) {empty} have no samples in the first step, so they cannot know the order "
                                   "of the other ranks' all-gathers (ZeRO-3): give every rank samples in every step "
                                   "(train_data_parallel's default pad=True does).")
        self._in_step = True
        self._forward_ran = self._backward_ran = False
        self._calls = []
        self._t0 = runtime.clock()
        if self.record_events:
            self.events.append([])
        for unit in self.units:
            unit.pending = len(unit.params)
            unit.forward_done = unit.backward_started = unit.reduced = False
        self._count("step starts")

    def start_step(self, count: int, loss_sum: float) -> tuple[int, float]:
        """Call after the forward pass, right before backward (every rank, with or without samples).

        Shares the loss sum and the sample count with every rank (one all-reduce of two numbers), so
        each layer's gradient can be divided by the global batch's size as soon as it is reduced.

        Args:
            count: samples this rank's loss averages over (0 if it had none this step).
            loss_sum: its loss summed over them.

        Returns:
            (total_count, global_mean_loss).
        """
        if not self._in_step:
            raise RuntimeError("call begin_step() before the forward pass, then start_step(count, loss_sum) "
                               "before backward (training.train_data_parallel does both).")
        if self._forward_ran:
            skipped = [u.name or type(u.module).__name__ for u in self.units if not u.forward_done]
            if skipped:
                raise RuntimeError(f"layer(s) {skipped} did not run in this forward pass: ShardedDataParallel needs "
                                   "every layer in every forward (the ranks' collectives must match).")
        elif self.stage == 3:
            # A rank without samples still takes part in every all-gather the others make in forward.
            for kind, index in self._replay("forward"):
                self._gather(self.units[index])
                self._free_params(self.units[index])
        self._calls.append(("stats", -1))
        stats = torch.tensor([loss_sum, count], dtype=self.units[0].flat.dtype, device=self.units[0].flat.device)
        with runtime.unchecked():
            self._allreduce(stats, "sum")
        total_loss, total = stats.tolist()
        self.total = int(round(total))
        self.global_loss = total_loss / total if total else float("nan")
        self._local_count = count
        self._next = len(self.units) - 1
        return self.total, self.global_loss

    def _replay(self, part: str) -> list:
        """The collectives this rank made in its last step with samples, before ('forward') or after
        ('backward') the loss-and-count all-reduce: a rank without samples repeats them, in order."""
        recorded = getattr(self, "_recorded", None)
        if recorded is None:
            raise RuntimeError(f"rank {self.rank} has no samples in its first step, so it cannot know the order of the "
                               "other ranks' all-gathers (ZeRO-3): give every rank samples in every step "
                               "(train_data_parallel's default pad=True does).")
        middle = recorded.index(("stats", -1))
        return recorded[:middle] if part == "forward" else recorded[middle + 1:]

    def finish_gradients(self) -> tuple[int, float]:
        """After backward: reduce every layer not reduced yet (no gradient: zeros), in order.

        A rank without samples (no forward, no backward) goes through the same all-gathers and
        reduce-scatters as the others, in the order this rank made them in its last step with samples,
        so every collective finds its partners.

        Returns:
            (total_count, global_mean_loss), as `start_step` did.
        """
        if self.stage == 3 and not self._backward_ran and self._next >= 0:
            for kind, index in self._replay("backward"):
                unit = self.units[index]
                if kind == "gather":
                    self._gather(unit)
                    self._new_grad_buffer(unit)
                else:
                    unit.pending = 0
                    self._reduce(unit)
            self._next = -1
        while self._next >= 0:
            self.units[self._next].pending = 0           # no gradient arrived (no samples, or unused): zeros
            self._reduce_ready()
        if self._forward_ran:
            self._recorded = list(self._calls)
        return self.total, self.global_loss

    def step(self, closure=None) -> None:
        """The optimizer step: every rank steps what it keeps; stages 1-2 then all-gather each layer."""
        if closure is not None:
            raise NotImplementedError("ShardedDataParallel.step takes no closure: compute the loss and call "
                                      "backward before step().")
        if not self._in_step:
            raise RuntimeError("step() before any gradient: call begin_step(), forward, start_step(count, loss_sum), "
                               "backward and finish_gradients() first (train_data_parallel does).")
        self.finish_gradients()
        t0 = runtime.clock()
        self.optimizer.step()
        self._count("after optimizer step")
        if self.stage in (1, 2):
            with runtime.unchecked():
                for unit in self.units:
                    self._calls.append(("gather after step", unit.index))
                    pieces = list(unit.flat.split(unit.piece))
                    collectives.all_gather(pieces, pieces[self.rank])
        self._event("step", None, t0)
        self._in_step = False
        self._step_count += 1
        self.zero_grad()
        sample = self._count("between steps")
        if self.census is not None and sample is not None:
            self.census.between_steps(sample)

    # --------------------------------------------------------------------------------- inspection

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (measured from the state tensors)."""
        from course_lib.training.memory import storage_bytes

        return storage_bytes(optimizer_tensors(self.optimizer))

    def memory_tensors(self) -> dict:
        """Every tensor this rank holds now, by kind: {'params': [...], 'grads': [...], 'optimizer': [...]}."""
        params, grads = [], []
        for unit in self.units:
            params += [unit.flat, unit.store, unit.shard]
            params += unit.params
            grads += [unit.grad, unit.shard.grad if unit.shard is not None else None]
            grads += [p.grad for p in unit.params]
        grads += self._in_flight
        return {"params": params, "grads": grads, "optimizer": optimizer_tensors(self.optimizer)}

    def _count(self, where: str):
        if self.census is None:
            return None
        held = self.memory_tensors()
        return self.census.count(where, held["params"], held["grads"], held["optimizer"])

    def _event(self, kind: str, unit: Unit | None, t0: float) -> None:
        if self.record_events and self.events:
            end = runtime.clock()
            self.events[-1].append(StepEvent(kind, -1 if unit is None else unit.index, t0 - self._t0, end - self._t0))

    def step_calls(self) -> list:
        """(name, messages) of every collective of the last step, in the order this rank made them, with the
        messages it sent in each: what `schedules.name_calls` needs to draw the step from its recording."""
        from course_lib.training.schedules import collective_messages, ring_messages

        if self.stage == 0 and self._allreduce_name != "ring":
            raise ValueError(f"step_calls knows the ring's messages; stage 0 here all-reduces with "
                             f"{self._allreduce_name!r}: use allreduce='ring' to draw its schedule.")
        g, out, backward = self.world_size, [], False
        for kind, index in self._calls:
            if kind == "stats":
                out.append(("loss and count", ring_messages(g)))
                backward = True
            elif kind == "gather":
                out.append((f"gather L{index}" + (" again" if backward else ""), collective_messages(g)))
            elif kind == "reduce":
                out.append((f"all-reduce L{index}", ring_messages(g)) if self.stage == 0 else
                           (f"reduce-scatter L{index}", collective_messages(g)))
            else:
                out.append((f"gather L{index} after step", collective_messages(g)))
        return out

    def full_parameters(self) -> torch.Tensor:
        """All parameters in one flat CPU tensor, model order (stage 3 all-gathers them: a collective,
        call it on every rank). Equal to `data_parallel.flat_parameters(model)` of an unsharded model."""
        out, calls = [], list(self._calls)            # the step's calls stay as they were (step_calls)
        for unit in self.units:
            if self.stage == 3:
                self._gather(unit)
            out += [p.detach().reshape(-1).cpu().clone() for p in unit.params]
            if self.stage == 3:
                self._free_params(unit)
        order = {id(p): i for i, p in enumerate(self.model.parameters())}
        flat_params = [p for u in self.units for p in u.params]
        ranked = sorted(zip(flat_params, out), key=lambda pair: order[id(pair[0])])
        self._calls = calls
        return torch.cat([t for _, t in ranked]) if ranked else torch.zeros(0)

    def close(self) -> None:
        """Remove the hooks (the model keeps its current, possibly sharded, storage)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _tensors(output):
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _tensors(item)]
    return []


def _units(model: nn.Module) -> list:
    """(name, module, numel) of every module that owns parameters directly, in registration order."""
    return [(name, module, sum(p.numel() for p in module.parameters(recurse=False)))
            for name, module in model.named_modules() if any(True for _ in module.parameters(recurse=False))]


def _check_model(model: nn.Module) -> Exception | None:
    params = list(model.parameters())
    if not params:
        return ValueError("the model has no parameters: there is nothing to shard.")
    if len({(p.dtype, p.device) for p in params}) > 1:
        return ValueError("all parameters must share one dtype and device to be cut into flat buffers; got "
                          f"{sorted({f'{p.dtype} on {p.device}' for p in params})}")
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    if frozen:
        return ValueError(f"parameters {frozen[:3]} do not require grad: ShardedDataParallel trains every "
                          "parameter of the model; leave frozen ones out of the model it wraps.")
    return None


def expected_bytes_sent(unit_numels, world_size: int, stage: int, rank: int = 0, element_size: int = 4,
                        steps: int = 1) -> int:
    """Bytes rank `rank` sends in `steps` training steps of `ShardedDataParallel` (ring all-reduces).

    Per step: the loss-and-count all-reduce (2 elements, ring), then per layer of n elements, P = ceil(n/G):
    stage 0 a ring all-reduce of n; stages 1-2 reduce-scatter and all-gather, (G-1) P each; stage 3
    two all-gathers and a reduce-scatter, 3 (G-1) P.
    """
    from course_lib import fast_allreduce

    def ring(numel):
        return fast_allreduce.expected_traffic("ring", numel, world_size, rank)["elements_sent"]

    g = world_size
    per_step = ring(2)
    for n in unit_numels:
        piece = math.ceil(n / g)
        per_step += {0: ring(n), 1: 2 * (g - 1) * piece, 2: 2 * (g - 1) * piece, 3: 3 * (g - 1) * piece}[stage]
    return steps * per_step * element_size
