"""Gradient buckets: all-reduce the last layers' gradients while backward still computes the first.

Backward produces gradients from the last layer to the first. Plain data parallelism waits for all of
them and then all-reduces one buffer; the network idles during backward and the processor idles
during the all-reduce. `DistributedDataParallel` instead cuts the gradients into *buckets* and starts
each bucket's all-reduce as soon as every gradient in it is ready, so communication of the last
layers runs while earlier layers' gradients are still being computed. This module does the same with
course_lib's hand-written all-reduce.

The plan (`plan_buckets`), as DDP makes it: walk the parameters in *reverse* order (the order
backward produces them) and close a bucket once it holds at least `bucket_bytes` of gradient. Every
bucket is one contiguous slice of the flat gradient buffer (parameters in forward order), so one
bucket big enough for everything *is* the buffer today's trainer all-reduces:

    flat buffer  [ p0 | p1 | p2 | p3 | p4 | p5 | loss_sum | count ]
                 |<- bucket 2 ->|<- bucket 1 ->|<---- bucket 0 ---->|     reduced 0, 1, 2
                                                 the two numbers ride with bucket 0

One step with ``overlap=True``, per rank (times relative to backward's start)::

    autograd thread:  backward  p5 p4 | p3 p2 | p1 p0 |              optimizer.step
                      hooks         ready 0   ready 1   ready 2 -> wait for all buckets
    comm thread:                 [all-reduce 0][all-reduce 1]  [all-reduce 2]

* A hook on every parameter (`Tensor.register_post_accumulate_grad_hook`, called once the
  parameter's ``.grad`` is complete) copies ``count * grad`` into the bucket's slice and, when the
  bucket's last gradient arrives, hands the bucket to the rank's communication thread.
* Buckets are launched strictly in index order 0, 1, 2, ...: bucket k waits for bucket k-1 even if
  its own gradients came first. Every rank therefore issues the same messages in the same order,
  which gloo needs (point-to-point messages between two ranks are matched by order, not by name).
* One communication thread per rank runs the all-reduces one after another with any
  `course_lib.allreduce` variant. It must be a thread: course_lib's all-reduce is a Python loop of
  blocking sends and receives, and it can only make progress while autograd computes if something
  else runs it. Autograd releases Python's GIL while it computes, and gloo releases it while it waits.
* After backward the trainer waits for every bucket, then divides by the total sample count and
  steps the optimizer exactly as before.

Limits, on purpose:

* Only the communication thread sends or receives while a step is in flight. `course_lib.traffic`
  labels and the launcher's "blocked in" line are module globals, one per process; they stay right
  because nobody else communicates meanwhile.
* The ranks agree on the bucket plan once, before training (`course_lib.runtime.agree`); the bucket
  all-reduces then run without the per-call agreement (it would add one small exchange of every rank's arguments per bucket).
* A parameter that gets no gradient in a step (unused in the forward pass) holds its bucket back
  until backward ends; its gradient counts as zero, as in today's trainer.
* On a CPU the "network" (gloo over loopback) and autograd share the same cores, so overlap can only
  hide the waiting inside an all-reduce, not the copying; on GPUs the two run on separate hardware.

Float results: with the 'naive' and 'parameter_server' variants every element is summed in rank
order whatever bucket it is in, so the parameters are bit-identical to today's trainer. The ring
sums each chunk starting at a different rank, and which chunk an element falls in depends on the
bucket boundaries, so with 3 or more ranks the sums differ by rounding (a + b = b + a exactly, so
with 2 ranks they are still bit-identical); with one bucket the buffer is today's, bit for bit.
"""

from __future__ import annotations

import collections
import functools
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from course_lib import runtime, traffic
from course_lib import allreduce as allreduce_variants

__all__ = ["Bucket", "BucketTiming", "StepTimeline", "plan_buckets", "GradientBuckets", "MIB"]

MIB = 1024 * 1024
_THREAD_NAME = "course_lib-comm"


@dataclass(frozen=True)
class Bucket:
    """One bucket of the plan.

    Attributes:
        index: launch order (0 = the last parameters, reduced first).
        params: indices into ``list(model.parameters())`` of the parameters it holds, forward order.
        offset: where its slice of the flat buffer starts.
        numel: elements of its slice (bucket 0 includes the two numbers loss_sum and count).
        nbytes: bytes of its slice.
    """

    index: int
    params: tuple
    offset: int
    numel: int
    nbytes: int


@dataclass
class BucketTiming:
    """When one bucket's all-reduce ran, in seconds after backward started, and what it sent.

    ``ready``: its last gradient arrived and every earlier bucket was launched; ``start``/``end``:
    the all-reduce itself. Without overlap all three are at or after the end of backward.
    """

    bucket: int
    numel: int
    nbytes: int
    ready: float = 0.0
    start: float = 0.0
    end: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0


@dataclass
class StepTimeline:
    """One training step on one rank, in seconds (a notebook draws it as a Gantt chart).

    Attributes:
        step: index of the step.
        forward: forward pass and loss (before backward starts).
        backward: backward pass; the buckets' times count from its start.
        communication_done: when the last bucket's all-reduce finished, after backward started.
        optimizer: optimizer.step().
        total: the whole step, from zero_grad to the end of optimizer.step.
        buckets: a `BucketTiming` per bucket, in launch order.
    """

    step: int
    forward: float = 0.0
    backward: float = 0.0
    communication_done: float = 0.0
    optimizer: float = 0.0
    total: float = 0.0
    buckets: list = field(default_factory=list)

    @property
    def exposed_communication(self) -> float:
        """Time the step waited for communication after backward had finished."""
        return max(0.0, self.communication_done - self.backward)

    @property
    def communication(self) -> float:
        """Time spent inside all-reduces (summed over buckets, overlapped or not)."""
        return sum(b.end - b.start for b in self.buckets)


def plan_buckets(params: list, bucket_bytes: float, extra_numel: int = 2) -> list[Bucket]:
    """Cut the parameters into buckets of at least `bucket_bytes` bytes, from the last parameter back.

    A parameter is never split. Bucket 0 holds the last parameters plus `extra_numel` trailing
    numbers (the sample count and loss sum). `bucket_bytes` may be ``math.inf``: one bucket.
    """
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, (int, float)) or not bucket_bytes > 0:
        raise ValueError(f"the bucket size must be a positive number of bytes (or math.inf for one bucket), "
                         f"got {bucket_bytes!r}")
    offsets = [0]
    for p in params:
        offsets.append(offsets[-1] + p.numel())
    element = params[0].element_size()
    groups, current, size = [], [], 0
    for i in reversed(range(len(params))):
        current.append(i)
        size += params[i].numel() * element
        if size >= bucket_bytes:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    buckets = []
    for index, group in enumerate(groups):
        first, last = min(group), max(group)
        numel = offsets[last + 1] - offsets[first] + (extra_numel if index == 0 else 0)
        buckets.append(Bucket(index, tuple(range(first, last + 1)), offsets[first], numel, numel * element))
    return buckets


class GradientBuckets:
    """Fill, reduce and hand back one flat gradient buffer per step, bucket by bucket.

    Used by `train_data_parallel` (``bucket_mb=`` / ``overlap=True``); a step goes::

        buckets.start_step(count, loss_sum)     # before backward: arms the hooks
        loss.backward()                         # hooks fill buckets; with overlap, reduce them too
        buffer, timings = buckets.finish()      # every bucket reduced (SUM); buffer = [sum of count*grad | loss | count]

    Args:
        params: the model's parameters (one dtype, one device).
        bucket_bytes: the bucket size (bytes of gradient), see `plan_buckets`.
        allreduce: a function ``f(tensor, op)`` that all-reduces in place (a course_lib variant).
        overlap: True: hooks and a communication thread reduce buckets during backward.
            False: `finish` reduces them after backward, one after another, on this thread.
        name: the variant's name, agreed on with the other ranks.
    """

    def __init__(self, params: list, bucket_bytes: float, allreduce: Callable, overlap: bool = True,
                 name: str = ""):
        self.params = list(params)
        self.buckets = plan_buckets(self.params, bucket_bytes)
        self.overlap = overlap
        self._allreduce = allreduce
        first = self.params[0]
        self.offsets = [b.offset for b in self.buckets]
        self._param_offsets = []
        offset = 0
        for p in self.params:
            self._param_offsets.append(offset)
            offset += p.numel()
        self.buffer = torch.zeros(offset + 2, dtype=first.dtype, device=first.device)
        self._bucket_of = {i: b.index for b in self.buckets for i in b.params}
        self._hooked = [p.requires_grad for p in self.params] if overlap else [False] * len(self.params)
        self._agree(name)
        self._lock = threading.Condition()
        self._handles, self._thread, self._queue = [], None, None
        self._waiter = None          # the training thread, while it waits in finish()
        self._comm_end = 0.0         # the communication thread's clock after its last bucket
        self._error: BaseException | None = None
        self._in_step = False
        if overlap:
            self._queue = collections.deque()   # (bucket or None, the clock when it was handed over), under _lock
            self._thread = threading.Thread(target=self._communicate, name=_THREAD_NAME, daemon=True)
            self._thread.start()
            for i, p in enumerate(self.params):
                if self._hooked[i]:
                    self._handles.append(p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i)))

    # ---------------------------------------------------------------------------------------------

    def _agree(self, name):
        """Every rank must cut the same buckets and reduce them the same way, or gloo mixes messages up."""
        sizes = ",".join(str(b.numel) for b in self.buckets)
        names = {runtime.name_code(known): repr(known) for known in allreduce_variants.VARIANTS}
        runtime.agree("train_data_parallel(bucket_mb=..., overlap=...)",
                      {"number of buckets": len(self.buckets), "bucket sizes": runtime.name_code(sizes),
                       "overlap": int(self.overlap), "allreduce": runtime.name_code(name)},
                      same=("number of buckets", "bucket sizes", "overlap", "allreduce"), device=self.buffer.device,
                      describe={"bucket sizes": lambda code: f"plan #{code}",
                                "allreduce": lambda code: names.get(code, f"a function (#{code})")})

    def _slice(self, bucket: Bucket) -> torch.Tensor:
        return self.buffer[bucket.offset:bucket.offset + bucket.numel]

    def _fill(self, i: int) -> None:
        """Write count * grad of parameter i into its place in the buffer (zeros if it has no grad)."""
        p, offset = self.params[i], self._param_offsets[i]
        target = self.buffer[offset:offset + p.numel()]
        if p.grad is None:
            target.zero_()
        else:
            torch.mul(p.grad.reshape(-1), self._count, out=target)

    def start_step(self, count: int, loss_sum: float) -> float:
        """Arm the buckets for one step; call it after the forward pass, right before backward.

        Returns:
            The `course_lib.clock()` instant the bucket timings of this step count from.
        """
        if self._error is not None:
            raise RuntimeError("the communication thread failed in an earlier step") from self._error
        self._count = count
        self.buffer[-2:] = self.buffer.new_tensor([loss_sum, count])
        self._seen = [False] * len(self.params)
        self._pending = [sum(self._hooked[i] for i in b.params) for b in self.buckets]
        self._timings = [BucketTiming(b.index, b.numel, b.nbytes) for b in self.buckets]
        self._launched, self._done = 0, 0
        for i, hooked in enumerate(self._hooked):   # frozen parameters: their (zero) gradient is known now
            if not hooked:
                self._fill(i)
        self._in_step = True
        self._t0 = runtime.clock()
        if self.overlap:
            with self._lock:
                self._launch_ready()   # a bucket of frozen parameters only is ready at once
        return self._t0

    def _on_grad(self, i: int, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook of parameter i: its .grad is complete for this backward."""
        if not self._in_step:
            return   # a backward outside the trainer's step: not ours to reduce
        if self._seen[i]:
            raise RuntimeError(f"parameter {i} received a second gradient in one step after its bucket may already "
                               "have been sent; call backward once per step when training with overlap=True.")
        self._seen[i] = True
        self._fill(i)
        with self._lock:
            self._pending[self._bucket_of[i]] -= 1
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Hand over every bucket that is complete and whose predecessors are launched (lock held)."""
        while self._launched < len(self.buckets) and self._pending[self._launched] == 0:
            k = self._launched
            self._timings[k].ready = runtime.clock() - self._t0
            self._launched += 1
            if self.overlap:
                self._hand_over(k)

    def _hand_over(self, k) -> None:
        """Queue bucket k (or None: stop) for the communication thread, with this thread's clock (lock held)."""
        self._queue.append((k, runtime.now()))
        runtime.wake(self._thread)
        self._lock.notify_all()

    def _reduce(self, k: int) -> None:
        timing = self._timings[k]
        timing.start = runtime.clock() - self._t0
        with traffic.record() as recording, runtime.unchecked():   # agreed on once, in __init__
            self._allreduce(self._slice(self.buckets[k]), "sum")
        timing.end = runtime.clock() - self._t0
        timing.bytes_sent, timing.bytes_received = recording.bytes_sent, recording.bytes_received
        timing.messages_sent = recording.messages_sent

    def _communicate(self) -> None:
        """The communication thread: reduce buckets in the order they are handed over, forever."""
        while True:
            with self._lock:
                runtime.idle(self._lock, lambda: bool(self._queue))
                k, handed_over = self._queue.popleft()
            if k is None:
                return
            runtime.catch_up(handed_over)     # the bucket was not ready before the training thread handed it over
            try:
                self._reduce(k)
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread, which raises it
                with self._lock:
                    self._error = exc
                    self._wake_trainer()
                return
            with self._lock:
                self._done += 1
                self._wake_trainer()

    def _wake_trainer(self) -> None:
        """(lock held) The training thread may be waiting in finish(): its clock follows this thread's."""
        self._comm_end = runtime.now()
        runtime.wake(self._waiter)
        self._lock.notify_all()

    def finish(self) -> tuple[torch.Tensor, list[BucketTiming]]:
        """After backward: make sure every bucket is reduced, and return the buffer and the timings.

        Gradients that never arrived (parameters unused in this step, or no backward at all because
        this rank had no samples) count as zero and release their buckets now.
        """
        if self.overlap:
            with self._lock:
                for i, seen in enumerate(self._seen):
                    if self._hooked[i] and not seen:
                        self._seen[i] = True
                        self._fill(i)
                        self._pending[self._bucket_of[i]] -= 1
                self._launch_ready()
                self._waiter = threading.current_thread()
                runtime.idle(self._lock, lambda: self._done >= len(self.buckets) or self._error is not None)
                self._waiter = None
                end = self._comm_end
            runtime.catch_up(end)          # the step's gradients are reduced when the last bucket is
            if self._error is not None:
                raise RuntimeError(f"the all-reduce of a gradient bucket failed on the communication thread: "
                                   f"{self._error!r}") from self._error
        else:
            for i in range(len(self.params)):
                self._fill(i)
            ready = runtime.clock() - self._t0
            for k in range(len(self.buckets)):
                self._timings[k].ready = ready
                self._reduce(k)
        self._in_step = False
        return self.buffer, self._timings

    def close(self) -> None:
        """Remove the hooks and stop the communication thread (always; the trainer calls it in `finally`)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._in_step = False
        if self._thread is not None:
            with self._lock:
                self._hand_over(None)
            if self._error is None and self._done == self._launched:
                self._thread.join(timeout=5.0)   # idle: it ends at once. Busy (an error elsewhere): leave it, daemon
            self._thread = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
