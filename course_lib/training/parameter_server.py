"""A parameter server, synchronous or asynchronous, with the staleness of every update measured.

Rank 0 is the *server*: it owns the parameters and the optimizer. Ranks 1 .. G-1 are *workers*:
each repeatedly computes a gradient on its own shard with the parameters it last received, *pushes*
the gradient to the server and waits for the reply, which carries the current parameters (the
*pull*). Every message has exactly one partner:

    server -> worker   tag 2   [ parameters ... | version | accepted | stop ]   (the first: the start)
    worker -> server   tag 1   [ gradient ...   | version | loss x count | count ]
    server -> worker   tag 2   the reply to that push, always exactly one

The *version* counts the updates the server has applied. A worker stamps each gradient with the
version of the parameters it computed it on, so the server can measure its *staleness*:

    staleness = (server's version when the gradient arrives) - (version it was computed on)

mode="sync": the server waits for one gradient from every worker, averages them (weighted by
    samples), applies one update and replies to everyone. Every gradient was computed on the
    current parameters: staleness is always 0, and the result is exactly data-parallel SGD. Each
    worker walks its shard `epochs` times; so does the server's loop, round by round.
mode="async": the server applies each gradient the moment it arrives and replies only to its
    sender. Nobody waits for anybody: a fast worker keeps cycling through its shard (epoch after
    epoch) and contributes more gradients than a slow one, and a gradient may have been computed on
    parameters several updates old. "First" is by arrival: under a modeled network, the push with the
    earliest modeled arrival, so the run is the same every time. With ``max_staleness=s`` the server
    refuses gradients older than s updates; the refused worker gets the current parameters and
    recomputes the same batch.
    After as many updates as the sync run has gradients (`epochs` passes over the data), the
    server answers every worker's next push with *stop*; that last gradient is discarded. Each
    worker has at most one push in flight, so every run ends with no message left unanswered.

`simulate_stale_sgd` shows the effect of staleness alone, deterministically, in one process.

Why staleness can make training diverge: on a quadratic loss with curvature L (the largest
eigenvalue of its Hessian), gradient descent whose gradients are s updates old moves along that
direction as x_{t+1} = x_t - lr L x_{t-s}, which shrinks to the minimum only while

    lr < 2 sin(pi / (2 (2 s + 1))) / L        s = 0: lr < 2 / L,  s = 1: lr < 1 / L,  s = 2: lr < 0.62 / L

(`stale_step_limit`; `sharpest_curvature` measures L of a real model and data set). A step size
between the s = 0 and the s = 1 limits trains synchronously and diverges asynchronously.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from course_lib import p2p
from course_lib import runtime
from course_lib.training import sharding
from course_lib.training.data_parallel import (_check_model, _dataset_len, _local_loss, flat_gradient,
                                                 set_flat_gradient, take_batch)

__all__ = ["ServerLog", "WorkerLog", "train_parameter_server", "simulate_stale_sgd", "stale_step_limit",
           "sharpest_curvature"]

PUSH_TAG, REPLY_TAG = 1, 2
_PUSH_EXTRA, _REPLY_EXTRA = 3, 3  # numbers after the gradient / the parameters in each message


@dataclass
class ServerLog:
    """What the server (rank 0) measured. One entry per applied update in the per-update lists.

    Attributes:
        mode, max_staleness: how it ran.
        staleness: per update, how many updates old the gradient(s) were (0 in sync mode).
        worker: per update, the worker whose gradient was applied (-1 in sync mode: all of them).
        batch_loss: per update, the loss the worker(s) measured on their batch (with stale parameters).
        loss: per update, the loss over the whole dataset right after the update (with evaluate=True).
        time: per update, seconds since training started, on `course_lib.clock()`: modeled seconds under
            `launch(..., network=...)` (the same on every run), this machine's clock otherwise.
        initial_loss: the whole-dataset loss before the first update.
        rejected: per worker rank, how many gradients the server refused as too stale.
        pushes: per worker rank, how many gradients the server considered (accepted + rejected; in
            async mode not counting the one that arrived after the last update and was answered 'stop').
        elapsed: seconds from the start to the last update (the same clock as `time`).
        parameters: the final parameters (flat, CPU).
    """

    mode: str = "async"
    max_staleness: int | None = None
    staleness: list = field(default_factory=list)
    worker: list = field(default_factory=list)
    batch_loss: list = field(default_factory=list)
    loss: list = field(default_factory=list)
    time: list = field(default_factory=list)
    initial_loss: float = float("nan")
    rejected: dict = field(default_factory=dict)
    pushes: dict = field(default_factory=dict)
    elapsed: float = 0.0
    parameters: torch.Tensor | None = None

    @property
    def updates(self) -> int:
        return len(self.staleness)


@dataclass
class WorkerLog:
    """What one worker saw.

    Attributes:
        versions: the version of the parameters each of its gradients was computed on, in order.
        accepted, rejected: how many of its gradients the server applied / refused as too stale.
        waited: seconds spent waiting for the server's replies (in sync mode: for the slowest worker), on
            `course_lib.clock()` (modeled under a modeled network).
    """

    rank: int = 0
    versions: list = field(default_factory=list)
    accepted: int = 0
    rejected: int = 0
    waited: float = 0.0


def _load_flat(model, flat: torch.Tensor) -> None:
    torch.nn.utils.vector_to_parameters(flat, model.parameters())


def _full_loss(model, dataset, loss_fn, device) -> float:
    n = _dataset_len(dataset)
    with torch.no_grad():
        return _local_loss(model, loss_fn, *take_batch(dataset, list(range(n)), device)).item()


def train_parameter_server(model: nn.Module, optimizer: torch.optim.Optimizer, dataset, loss_fn: Callable, *,
                           batch_size: int, epochs: int = 1, mode: str = "async", max_staleness: int | None = None,
                           shuffle: bool = True, seed: int = 0, worker_delays: Sequence[float] | None = None,
                           evaluate: bool = True):
    """Train with rank 0 as parameter server and ranks 1..G-1 as workers; call it on every rank.

    Args:
        model, optimizer: built the same way on every rank; only the server's optimizer steps, and
            the workers start from the server's parameters.
        dataset, loss_fn, batch_size, shuffle, seed: as in `train_data_parallel`; the data is dealt
            out to the G-1 workers with `DistributedSampler`'s rule (padded shards, so every worker
            has the same number of batches per epoch).
        epochs: sync: every worker walks its shard this many times. async: the server applies as
            many updates as the sync run has gradients; fast workers contribute more of them.
        mode: "sync" or "async" (see the module docstring).
        max_staleness: async only: refuse gradients more than this many updates old (None: accept all).
        worker_delays: seconds of compute each rank spends before computing a gradient, index = rank (entry 0
            is ignored): stands in for slower and faster GPUs (`course_lib.compute`: a sleep, or modeled time
            under a modeled network).
        evaluate: the server measures the whole-dataset loss after every update (for loss curves).

    Returns:
        A `ServerLog` on rank 0, a `WorkerLog` on every worker.
    """
    if mode not in ("sync", "async"):
        raise ValueError(f"mode must be 'sync' or 'async', got {mode!r}")
    if max_staleness is not None and (mode == "sync" or not isinstance(max_staleness, int) or max_staleness < 0):
        raise ValueError("max_staleness is a whole number >= 0, and only means something with mode='async'")
    _check_model(model)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size < 2:
        raise ValueError("a parameter server needs at least 2 ranks: rank 0 serves, the others compute")
    if mode == "async" and dist.get_backend() == "nccl":
        raise ValueError("the asynchronous server receives from whichever worker is first (recv with src=None), "
                         "which gloo supports and NCCL does not: launch it with backend='gloo'")
    workers = world_size - 1
    n = _dataset_len(dataset)
    per_epoch = sharding.steps_per_epoch(n, workers, batch_size)
    if per_epoch * epochs < 1:
        raise ValueError(f"{n} samples over {workers} workers leave a worker nothing to train on")
    delays = list(worker_delays) if worker_delays is not None else [0.0] * world_size
    if len(delays) != world_size:
        raise ValueError(f"worker_delays needs one entry per rank ({world_size}), got {len(delays)}")
    if rank == 0:
        return _serve(model, optimizer, dataset, loss_fn, workers, per_epoch * epochs, mode, max_staleness, evaluate)
    if mode == "sync":
        batches = [batch for epoch in range(epochs)
                   for batch in sharding.split_batches(
                       sharding.shard_indices(n, rank - 1, workers, shuffle=shuffle, seed=seed, epoch=epoch), batch_size)]
    else:
        batches = _endless_batches(n, rank - 1, workers, batch_size, shuffle, seed)
    return _work(model, dataset, loss_fn, batches, delays[rank])


def _work(model, dataset, loss_fn, batches, delay) -> WorkerLog:
    """A worker: pull, then push a gradient and pull the answer, once per batch (again if refused).

    `batches` may be endless (async): the worker stops when the server's reply says so.
    """
    device = next(model.parameters()).device
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    reply = torch.empty(flat.numel() + _REPLY_EXTRA, dtype=flat.dtype, device=device)
    push = torch.empty(flat.numel() + _PUSH_EXTRA, dtype=flat.dtype, device=device)
    log = WorkerLog(rank=dist.get_rank())
    p2p.recv(reply, 0, tag=REPLY_TAG)                           # the starting parameters
    _load_flat(model, reply[:-_REPLY_EXTRA])
    version = int(reply[-_REPLY_EXTRA].item())
    for batch in batches:
        accepted = False
        while not accepted:
            if delay:
                runtime.compute(delay)
            model.zero_grad()
            loss = _local_loss(model, loss_fn, *take_batch(dataset, batch, device))
            loss.backward()
            push[:-_PUSH_EXTRA] = flat_gradient(model)
            push[-_PUSH_EXTRA:] = torch.tensor([version, loss.item() * len(batch), len(batch)])
            start = runtime.clock()
            p2p.send(push, 0, tag=PUSH_TAG)
            p2p.recv(reply, 0, tag=REPLY_TAG)
            log.waited += runtime.clock() - start
            _load_flat(model, reply[:-_REPLY_EXTRA])
            stop = bool(reply[-1].item())
            if stop:                          # training is over; this last gradient was not used
                return log
            log.versions.append(version)
            version, accepted = int(reply[-_REPLY_EXTRA].item()), bool(reply[-2].item())
            log.accepted, log.rejected = log.accepted + accepted, log.rejected + (not accepted)
    return log


def _endless_batches(dataset_len, worker, workers, batch_size, shuffle, seed):
    """A worker's batches, epoch after epoch, for as long as the server wants gradients."""
    epoch = 0
    while True:
        mine = sharding.shard_indices(dataset_len, worker, workers, shuffle=shuffle, seed=seed, epoch=epoch)
        yield from sharding.split_batches(mine, batch_size)
        epoch += 1


def _serve(model, optimizer, dataset, loss_fn, workers, rounds, mode, max_staleness, evaluate) -> ServerLog:
    """The server loop of either mode; returns its measurements.

    `rounds`: sync rounds (each worker's batches per run). Async applies `workers x rounds` updates,
    as many as there are gradients in the sync run.
    """
    device = next(model.parameters()).device
    params = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    size = params.numel()
    if rounds * workers >= 2 ** 24 and params.dtype == torch.float32:
        raise ValueError("too many updates to stamp versions exactly in float32 messages")
    log = ServerLog(mode=mode, max_staleness=max_staleness, rejected={w: 0 for w in range(1, workers + 1)},
                    pushes={w: 0 for w in range(1, workers + 1)})
    version = 0

    def reply_to(dst, accepted, stop=False, wait=True):
        message = torch.cat([torch.nn.utils.parameters_to_vector(model.parameters()).detach(),
                             torch.tensor([version, accepted, stop], dtype=params.dtype, device=device)])
        request = p2p.isend(message, dst, tag=REPLY_TAG)
        if wait:
            request.wait()
        return request, message

    def apply(gradient, staleness, worker, batch_loss):
        nonlocal version
        optimizer.zero_grad()
        set_flat_gradient(model, gradient)
        optimizer.step()
        version += 1
        log.staleness.append(staleness)
        log.worker.append(worker)
        log.batch_loss.append(batch_loss)
        log.time.append(runtime.clock() - start)
        if evaluate:
            log.loss.append(_full_loss(model, dataset, loss_fn, device))

    if evaluate:
        log.initial_loss = _full_loss(model, dataset, loss_fn, device)
    start = runtime.clock()
    _wait_all([reply_to(w, True, wait=False) for w in range(1, workers + 1)])    # everyone's first pull
    push = torch.empty(size + _PUSH_EXTRA, dtype=params.dtype, device=device)
    if mode == "sync":
        for _ in range(rounds):
            gradient, loss_sum, count = torch.zeros(size, dtype=params.dtype, device=device), 0.0, 0
            for w in range(1, workers + 1):        # a fixed order: the sum is the same every run
                p2p.recv(push, w, tag=PUSH_TAG)
                pushed_version, w_loss, w_count = push[-_PUSH_EXTRA:].tolist()
                gradient += push[:size] * w_count
                loss_sum, count = loss_sum + w_loss, count + int(w_count)
                log.pushes[w] += 1
                assert int(pushed_version) == version, "sync mode: a worker computed on old parameters"
            apply(gradient / count, 0, -1, loss_sum / count)
            _wait_all([reply_to(w, True, wait=False) for w in range(1, workers + 1)])
    else:
        told_to_stop = 0
        while told_to_stop < workers:
            sender = p2p.recv(push, None, tag=PUSH_TAG)              # whichever worker is first
            if version >= workers * rounds:                          # training is over: send it home
                reply_to(sender, False, stop=True)
                told_to_stop += 1
                continue
            pushed_version, w_loss, w_count = push[-_PUSH_EXTRA:].tolist()
            staleness = version - int(pushed_version)
            accepted = max_staleness is None or staleness <= max_staleness
            log.pushes[sender] += 1
            if accepted:
                apply(push[:size].clone(), staleness, sender, w_loss / w_count)
            else:
                log.rejected[sender] += 1
            reply_to(sender, accepted)
    log.elapsed = log.time[-1] if log.time else 0.0
    log.parameters = torch.nn.utils.parameters_to_vector(model.parameters()).detach().cpu().clone()
    return log


def _wait_all(pending):
    for request, _message in pending:   # the message is kept alive until its send completes
        request.wait()


def simulate_stale_sgd(model: nn.Module, dataset, loss_fn: Callable, *, lr: float, batch_size: int, steps: int,
                       staleness: int, seed: int = 0) -> list[float]:
    """Plain SGD in one process where every gradient is `staleness` updates old when it is applied.

    Step t computes the gradient at the parameters of step t - staleness (the start, for the first
    steps) on batch t, and applies it to the current parameters: what an asynchronous worker does
    when `staleness` other updates land while it computes. No timing is involved, so the result is
    the same on every run.

    Returns:
        The whole-dataset loss before the first step and after every step (steps + 1 numbers).
    """
    _check_model(model)
    device = next(model.parameters()).device
    n = _dataset_len(dataset)
    order = [i for epoch in range(steps * batch_size // n + 1)
             for i in sharding.epoch_order(n, 1, shuffle=True, seed=seed, epoch=epoch)]
    history = collections.deque([torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()],
                                maxlen=staleness + 1)
    current = history[-1].clone()
    losses = [_full_loss(model, dataset, loss_fn, device)]
    for t in range(steps):
        _load_flat(model, history[0])                     # the parameters the gradient is computed on
        model.zero_grad()
        _local_loss(model, loss_fn, *take_batch(dataset, order[t * batch_size:(t + 1) * batch_size], device)).backward()
        current = current - lr * flat_gradient(model)
        history.append(current.clone())
        _load_flat(model, current)
        losses.append(_full_loss(model, dataset, loss_fn, device))
    return losses


def stale_step_limit(curvature: float, staleness: int) -> float:
    """The largest stable step size of gradient descent on a quadratic when every gradient is stale.

    Along the Hessian's sharpest direction (eigenvalue L = `curvature`) a gradient computed s updates
    ago gives x_{t+1} = x_t - lr L x_{t-s}. That recursion shrinks to 0 exactly when

        0 < lr L < 2 sin(pi / (2 (2 s + 1)))

    (Levin and May's condition for x_{t+1} = x_t - a x_{t-s}, written with a sine). With s = 0 it is
    the familiar lr < 2 / L; every update of staleness costs stability: s = 1 halves the limit.
    """
    if curvature <= 0 or staleness < 0:
        raise ValueError("curvature must be > 0 and staleness >= 0")
    return 2 * math.sin(math.pi / (2 * (2 * staleness + 1))) / curvature


def sharpest_curvature(model: nn.Module, dataset, loss_fn: Callable, iterations: int = 200, seed: int = 0) -> float:
    """L: the largest eigenvalue of the Hessian of the whole-dataset loss at the model's parameters.

    Power iteration: v <- H v / |H v|, with each Hessian-vector product H v taken by differentiating
    the gradient a second time, so H itself is never built. It finds the eigenvalue largest in size,
    which for a convex loss is the largest. For a linear model with mean squared error the loss is
    a quadratic and L does not depend on where it is measured.
    """
    _check_model(model)
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device
    inputs, targets = take_batch(dataset, list(range(_dataset_len(dataset))), device)
    grads = torch.autograd.grad(_local_loss(model, loss_fn, inputs, targets), params, create_graph=True)
    flat_grad = torch.cat([g.reshape(-1) for g in grads])
    vector = torch.randn(flat_grad.numel(), generator=torch.Generator().manual_seed(seed)).to(flat_grad)
    eigenvalue = 0.0
    for _ in range(iterations):
        vector = vector / vector.norm()
        product = torch.autograd.grad(flat_grad @ vector, params, retain_graph=True)
        product = torch.cat([p.reshape(-1) for p in product])
        eigenvalue = float(vector @ product)
        vector = product.detach()
    return eigenvalue
