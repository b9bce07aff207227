"""ZeRO-1: every rank keeps the optimizer state of 1/G of the parameters only.

In plain data parallelism every rank runs the same optimizer on the same averaged gradient, so every
rank holds the same optimizer state, G times over. Adam keeps two numbers per parameter (exp_avg and
exp_avg_sq), twice the model itself, on every rank. ZeRO stage 1 (Rajbhandari et al., 2020) keeps each
piece of that state on one rank only. It rests on one identity:

    all-reduce  =  reduce-scatter  +  all-gather                 (the ring's two phases)

and moves the optimizer step between the two halves. Flat parameter vector of N elements, cut into G
shards with ``torch.tensor_split`` (the first N mod G shards one element longer); on rank r:

    1. reduce-scatter the gradients:  rank r receives the summed gradient of shard r only
    2. optimizer step on shard r:     Adam's state exists for shard r only (2 N / G numbers)
    3. all-gather the parameters:     every rank receives every updated shard

Each rank sends (G-1) N / G elements in 1. and (G-1) N / G in 3., the same as a ring all-reduce
(2 (G-1) N / G), and the parameters after the step are those of plain data parallelism: Adam, SGD
with momentum, weight decay and the like update every element on its own, so updating a shard of
the flat vector is updating those elements of the parameters. (An optimizer that looks at a whole
tensor at once, like LAMB's per-layer norms, would see shards instead and differ.)

Built from `course_lib.collectives.reduce_scatter` and `collectives.all_gather`, which want pieces of
one size: shards are padded to ceil(N / G) elements for the messages (at most G-1 elements of
padding per message), and the optimizer only ever sees the real shard. The sample count and loss sum
ride along at the end of every piece, so every rank learns the global batch's size (as in
`data_parallel.average_gradients`).

Use it in place of the optimizer::

    optimizer = zero.ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    log = training.train_data_parallel(model, optimizer, data, loss_fn, batch_size=16)
    optimizer.state_bytes()        # about 1/G of torch.optim.Adam(model.parameters()) after a step

or in your own loop: ``loss.backward(); optimizer.step()`` (step reduce-scatters the gradients
itself, every rank's gradient weighted the same, if `reduce_gradients` was not called first).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from course_lib import collectives, runtime
from course_lib.allreduce import chunk_sizes
from course_lib.training.data_parallel import flat_gradient

__all__ = ["ShardedOptimizer", "optimizer_state_bytes"]


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of the tensors an optimizer keeps as state (exp_avg, momentum buffers, step counts ...).

    Measured from the tensors themselves: every distinct storage in ``optimizer.state`` counted once.
    A `ShardedOptimizer` answers for its inner optimizer, which holds this rank's shard only.
    """
    inner = getattr(optimizer, "optimizer", optimizer)
    seen, total = set(), 0
    for state in inner.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                key = (storage.data_ptr(), value.device)
                if key not in seen:
                    seen.add(key)
                    total += storage.nbytes()
    return total


class ShardedOptimizer:
    """An optimizer whose state is split over the ranks: rank r keeps the state of shard r (ZeRO-1).

    Args:
        params: the model's parameters (an iterable of tensors, one dtype and device; the same
            shapes on every rank). Parameter groups are not supported.
        optimizer_class: the optimizer to run on the shard, e.g. ``torch.optim.Adam``; it must update
            every element on its own (see the module docstring).
        **defaults: its arguments (lr, betas, momentum, weight_decay, ...).

    Attributes:
        optimizer: the inner optimizer, over one parameter: this rank's shard of the flat vector.
        shard: that parameter (a working copy of the shard, refreshed from the model before every step).
        shard_sizes: the G shard lengths (``torch.tensor_split`` of N elements).
        shard_range: (start, stop) of this rank's shard in the flat parameter vector.

    Example::

        >>> def fn(rank, world_size):
        ...     model = toy.make_mlp(hidden=31, seed=0)
        ...     optimizer = ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
        ...     training.train_data_parallel(model, optimizer, data, F.cross_entropy, batch_size=8)
        ...     return optimizer.state_bytes()
    """

    def __init__(self, params, optimizer_class, **defaults):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("ShardedOptimizer splits its state over the ranks of a process group: create it "
                               "inside a function started by course_lib.launch (or under torchrun).")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError("optimizer_class must be a torch.optim.Optimizer class such as torch.optim.Adam "
                            f"(the class, not an instance), got {optimizer_class!r}")
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        problem = _check_params(params)
        self.params = params
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        numel = sum(p.numel() for p in params) if problem is None else -1
        dtype = runtime.dtype_code(params[0].dtype) if problem is None else -1
        # Every rank must cut the same vector, or the pieces of the collectives would not fit.
        runtime.agree("ShardedOptimizer", {"numel": numel, "dtype": dtype}, same=("numel", "dtype"), problem=problem,
                      describe={"numel": lambda n: f"{n} parameter elements"})
        self.numel = numel
        self.shard_sizes = chunk_sizes(numel, self.world_size)
        start = sum(self.shard_sizes[:self.rank])
        self.shard_range = (start, start + self.shard_sizes[self.rank])
        self._piece = self.shard_sizes[0]   # the longest shard: every message is this long
        self.shard = nn.Parameter(self._read_shard())
        self.optimizer = optimizer_class([self.shard], **defaults)
        self._reduced = False

    # ---------------------------------------------------------------------------------------------

    @property
    def param_groups(self):
        """The inner optimizer's parameter groups (change ``lr`` here, as with any optimizer)."""
        return self.optimizer.param_groups

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (measured; see `optimizer_state_bytes`)."""
        return optimizer_state_bytes(self.optimizer)

    def shard_bytes(self) -> int:
        """Bytes of the working copy of this rank's parameter shard (kept beside the model)."""
        return self.shard.numel() * self.shard.element_size()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients (and the shard's)."""
        for p in self.params + [self.shard]:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    # ---------------------------------------------------------------------------------------------

    def _segments(self, start: int, stop: int):
        """(flat view of a parameter's elements, their range in [start, stop)) for every parameter
        that overlaps the flat range [start, stop)."""
        offset = 0
        for p in self.params:
            lo, hi = max(start, offset), min(stop, offset + p.numel())
            if lo < hi:
                yield p.detach().view(-1)[lo - offset:hi - offset], (lo - start, hi - start)
            offset += p.numel()

    def _read_shard(self) -> torch.Tensor:
        first = self.params[0]
        shard = torch.empty(self.shard_range[1] - self.shard_range[0], dtype=first.dtype, device=first.device)
        for values, (lo, hi) in self._segments(*self.shard_range):
            shard[lo:hi] = values
        return shard

    def reduce_gradients(self, count: int = 1, loss_sum: float = 0.0) -> tuple[int, float]:
        """Phase 1: reduce-scatter ``count * grad`` (with count and loss sum); shard.grad = the global mean.

        Args:
            count: samples this rank's gradient averages over (`train_data_parallel` passes it, so
                uneven batches weigh right); leave 1 to weigh every rank the same.
            loss_sum: this rank's loss summed over its samples, for the global mean loss.

        Returns:
            (total_count, global_mean_loss), like `data_parallel.average_gradients`.
        """
        weighted = flat_gradient(self.params) * count
        tail = weighted.new_tensor([loss_sum, count])
        padding = weighted.new_zeros(self._piece)
        pieces = [torch.cat([shard, padding[:self._piece - shard.numel()], tail])
                  for shard in torch.tensor_split(weighted, self.world_size)]
        mine = torch.empty_like(pieces[0])
        collectives.reduce_scatter(mine, pieces, op="sum")
        total_count, total_loss = mine[-1].item(), mine[-2].item()
        self.shard.grad = mine[:self.shard.numel()] / total_count
        self._reduced = True
        return int(round(total_count)), total_loss / total_count

    def step(self, closure=None) -> None:
        """Phases 2 and 3: step the shard with the inner optimizer, then all-gather the parameters."""
        if closure is not None:
            raise NotImplementedError("ShardedOptimizer.step takes no closure: compute the loss and call "
                                      "backward before step().")
        if not self._reduced:
            self.reduce_gradients()
        with torch.no_grad():
            self.shard.copy_(self._read_shard())   # the model's current values (after a broadcast, say)
        self.optimizer.step()                                                               # phase 2
        self.shard.grad, self._reduced = None, False
        mine = self.shard.detach().new_zeros(self._piece)
        mine[:self.shard.numel()] = self.shard.detach()
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        collectives.all_gather(gathered, mine)                                              # phase 3
        start = 0
        for piece, size in zip(gathered, self.shard_sizes):
            for values, (lo, hi) in self._segments(start, start + size):
                values.copy_(piece[lo:hi])
            start += size


def _check_params(params) -> Exception | None:
    """What is wrong with the parameter list, as an exception to raise on every rank (None: nothing)."""
    if not params:
        return ValueError("ShardedOptimizer got no parameters: pass model.parameters() of a model that has some.")
    if any(isinstance(p, dict) for p in params):
        return TypeError("ShardedOptimizer takes one list of parameters, not parameter groups (dicts).")
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            return TypeError(f"parameter {i} is a {type(p).__name__}, not a tensor; pass model.parameters().")
    if len({(p.dtype, p.device) for p in params}) > 1:
        return ValueError("all parameters must share one dtype and device to be cut from one flat vector; got "
                          f"{sorted({f'{p.dtype} on {p.device}' for p in params})}")
    return None
