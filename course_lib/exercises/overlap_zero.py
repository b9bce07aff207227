"""Notebook 11: gradient buckets all-reduced while backward still runs, and a ZeRO-1 optimizer step.

    overlapped_buckets(buckets, start_allreduce) -> finish
        `buckets[k]` is a list of parameters (bucket 0 holds the last layers: backward fills it first).
        Register hooks (``p.register_post_accumulate_grad_hook``) so that the moment the last gradient of bucket k
        is ready, its gradients are copied into one flat tensor and ``handle = start_allreduce(k, flat)`` starts
        its non-blocking all-reduce (sum, in place, on a communication thread the check provides). Return
        ``finish()``: called after ``loss.backward()`` and before ``optimizer.step()``, it waits for every
        bucket (``handle.wait()``), divides by G and writes the mean back into each ``p.grad``.

    zero1_step(flat_params, momentum) -> step
        ZeRO-1 for SGD with momentum (lr LR, momentum 0.9): rank r owns shard r = torch.tensor_split(flat, G)[r]
        and keeps the momentum buffer of that shard only. Return ``step(flat_grad)``, which, given this rank's
        local gradient of its mean loss, (1) reduce-scatters it so rank r holds the sum of shard r and divides
        by G; (2) updates its shard: buf = momentum buf + g, shard -= lr buf; (3) all-gathers the updated shards
        into `flat_params`, in place. Return the optimizer-state tensors too, ``return step, [buffer]``, so the
        check can count their bytes: about 4 |shard r| = 4 N / G.

Both are checked like notebook 07's `average_gradients`: a small MLP, three steps, every rank on its slice of
each global batch; the parameters after every step must equal one process training on the whole global batches
(which the judge trains itself). The overlap check also reads, in order, every gradient becoming ready, every
start and wait of a bucket, the end of backward and the step: "bucket 2's all-reduce was started after backward
finished: nothing overlapped". The ZeRO check reads what the all-gather carried (updated parameters, not
gradient sums) and how many bytes each rank's optimizer state holds.
"""

from __future__ import annotations

import queue
import threading

import torch
import torch.nn.functional as F

from course_lib.exercises import data
from course_lib.exercises.cases import clone
from course_lib.exercises.registry import FunctionExercise, Problem, register
from course_lib.exercises.rubric import SINGLE_RANK, RubricLine
from course_lib.exercises.training_step import (BATCH, LR, STEPS, AverageGradients, _dataset, _global_batches,
                                                _model, _one_thread, training_cases)

__all__ = ["OverlappedBuckets", "Zero1Step", "BUCKET_BYTES", "MOMENTUM", "plan"]

BUCKET_BYTES = 100     # a bucket closes once it holds 100 bytes or more: 3 or more buckets for these small MLPs
MOMENTUM = 0.9


def plan(model, bucket_bytes: int = BUCKET_BYTES) -> list[list[int]]:
    """DDP's rule: parameter indices in the order backward makes them (last first), whole, until >= bucket_bytes."""
    params = list(model.parameters())
    buckets, current, held = [], [], 0
    for index in reversed(range(len(params))):
        current.append(index)
        held += params[index].numel() * params[index].element_size()
        if held >= bucket_bytes:
            buckets, current, held = buckets + [current], [], 0
    return buckets + ([current] if current else [])


# --------------------------------------------------------------------------------------------------
# Overlapped buckets
# --------------------------------------------------------------------------------------------------


class _Handle:
    def __init__(self, log, k):
        self.done, self.log, self.k = threading.Event(), log, k

    def wait(self):
        self.log.append(("wait", self.k))
        self.done.wait()


class _CommunicationThread:
    """The non-blocking all-reduce the check hands the learner: buckets queue up and a thread all-reduces them (sum,
    in place) one after another, in the order they were started (the same on every rank: gloo matches messages by
    order)."""

    def __init__(self, log):
        self.log, self.queue = log, queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True, name="course_lib-exercise-buckets")
        self.thread.start()

    def start_allreduce(self, k, tensor):
        self.log.append(("start", int(k) if isinstance(k, int) else -1, tensor.numel()))
        handle = _Handle(self.log, k)
        self.queue.put((tensor, handle))
        return handle

    def _run(self):
        from course_lib import allreduce

        while True:
            item = self.queue.get()
            if item is None:
                return
            tensor, handle = item
            try:
                allreduce.ring(tensor.detach().view(-1) if tensor.is_contiguous() else tensor.detach())
            finally:
                handle.done.set()

    def close(self):
        self.queue.put(None)
        self.thread.join(timeout=30)


class OverlappedBuckets(AverageGradients):
    observed = ("averaged", "parameters", "events")     # its cases are average_gradients' (the 123-parameter model)

    def run_case(self, call, case, rank, world_size, inputs):
        from course_lib.training.data_parallel import flat_gradient, flat_parameters

        model = _model(case)
        params = list(model.parameters())
        events = []
        for index, p in enumerate(params):      # registered first: fires before the learner's hook on the same p
            p.register_post_accumulate_grad_hook(lambda _p, i=index: events.append(("grad", i)))
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        data_x, data_y = _dataset(case)
        comm = _CommunicationThread(events)
        buckets = [[params[i] for i in bucket] for bucket in plan(model)]
        averaged, parameters = [], []
        try:
            finish = call(buckets, comm.start_allreduce)
            with call.tracer:
                for step, batch in enumerate(_global_batches(case)):
                    events.append(("step_begins", step))
                    mine = batch[rank * BATCH:(rank + 1) * BATCH]
                    optimizer.zero_grad()
                    F.cross_entropy(model(data_x[mine]), data_y[mine]).backward()
                    events.append(("backward_end",))
                    finish()
                    events.append(("optimizer_step",))
                    averaged.append(clone(flat_gradient(model)))
                    optimizer.step()
                    parameters.append(flat_parameters(model))
        finally:
            comm.close()
        return {"averaged": averaged, "parameters": parameters, "events": [tuple(e) for e in events]}

    def judge(self, case, records, complete=True):
        if not complete:
            return []
        problems = []
        buckets = plan(_model(case))
        names = [name for name, _ in _model(case).named_parameters()]
        for rank, record in enumerate(records):
            found = _overlap_problems(record["events"], buckets, names, rank, case.world_size)
            if found:
                problems.append(found)
                break
        return problems + super().judge(case, records, complete)


def _overlap_problems(events, buckets, names, rank, G):
    """The first thing wrong with when one rank's buckets were started and waited for, as a Problem, or None."""
    steps, current = [], None
    for event in events:
        if event[0] == "step_begins":
            current = []
            steps.append(current)
        elif current is not None:
            current.append(tuple(event))
    for step, seq in enumerate(steps):
        position = {e: i for i, e in reversed(list(enumerate(seq)))}
        end = position.get(("backward_end",), len(seq))
        stepped = position.get(("optimizer_step",), len(seq))
        starts = [i for i, e in enumerate(seq) if e[0] == "start"]
        for k, bucket in enumerate(buckets):
            mine = [i for i in starts if seq[i][1] == k]
            last_grad = max(position.get(("grad", p), -1) for p in bucket)
            last_name = names[max(bucket, key=lambda p: position.get(("grad", p), -1))]
            where = f"step {step}: rank {rank}'s bucket {k} ({', '.join(names[p] for p in bucket)})"
            if not mine:
                return Problem(f"{where}: its all-reduce was never started with start_allreduce({k}, flat): each bucket "
                               "starts from a gradient hook once its last gradient is ready.", order=(-1, step, k, rank),
                               line="overlap")
            if len(mine) > 1:
                return Problem(f"{where}: its all-reduce was started {len(mine)} times; a hook must start each bucket "
                               "once per step (count the gradients that arrived, and reset the count for the next "
                               "step).", order=(-1, step, k, rank), line="mean")
            start = mine[0]
            if start < last_grad:
                return Problem(f"{where}: its all-reduce was started before its last gradient ({last_name}) was ready: "
                               "it summed a bucket that was not complete. Start it from the hook of the bucket's last "
                               "gradient.", order=(-1, step, k, rank), line="overlap")
            if start > end:
                return Problem(f"{where}: its all-reduce was started after backward finished: nothing overlapped. Start "
                               "it from the gradient hook, the moment its last gradient is ready, so it runs while "
                               "backward computes the earlier layers.", order=(-1, step, k, rank), line="overlap")
            waits = [i for i, e in enumerate(seq) if e[0] == "wait" and e[1] == k]
            if any(i < end for i in waits):
                return Problem(f"{where}: its all-reduce was waited for inside backward (in the hook): backward stopped "
                               "until it finished, so nothing overlapped. Wait in finish(), after backward.",
                               order=(-1, step, k, rank), line="overlap")
            if not any(end < i < stepped for i in waits):
                return Problem(f"{where}: its all-reduce was never waited for before optimizer.step(): the step may read "
                               "gradients the all-reduce has not finished. finish() waits for every bucket.",
                               order=(-1, step, k, rank), line="wait")
    return None


# --------------------------------------------------------------------------------------------------
# ZeRO-1
# --------------------------------------------------------------------------------------------------


class Zero1Step(FunctionExercise):
    observed = ("parameters", "state_bytes", "step_messages")

    def cases(self):
        import course_lib.training  # noqa: F401 - imported once here, not in every forked rank
        return training_cases("tagged")       # the 123-parameter model, G = 1..4

    def inputs(self, case):
        return [None] * case.world_size

    def oracle(self, case, inputs):
        from course_lib.training.data_parallel import flat_parameters, train_single_process

        model = _model(case)
        initial = flat_parameters(model)
        data_x, data_y = _dataset(case)
        with _one_thread():
            log = train_single_process(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
                                       (data_x, data_y), F.cross_entropy, batches=_global_batches(case),
                                       record_parameters=True)
        facts = {"initial": initial, "reference": [p.clone() for p in log.parameters[1:STEPS + 1]]}
        return [dict(facts) for _ in range(case.world_size)]

    def run_case(self, call, case, rank, world_size, inputs):
        from course_lib.training.data_parallel import flat_gradient, flat_parameters

        model = _model(case)
        flat = flat_parameters(model).clone()
        data_x, data_y = _dataset(case)
        made = call(flat, MOMENTUM)
        step, state = (made, None) if callable(made) else made
        parameters, step_messages = [], []
        for batch in _global_batches(case):
            mine = batch[rank * BATCH:(rank + 1) * BATCH]
            torch.nn.utils.vector_to_parameters(flat, model.parameters())
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(data_x[mine]), data_y[mine]).backward()
            first = len(call.messages)
            with call.tracer:
                step(clone(flat_gradient(model)))
            step_messages.append((first, len(call.messages)))
            parameters.append(flat.clone())
        tensors = state if isinstance(state, (list, tuple)) else [state]
        seen, state_bytes = set(), 0
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in seen:
                seen.add(tensor.untyped_storage().data_ptr())
                state_bytes += tensor.numel() * tensor.element_size()
        return {"parameters": parameters, "state_bytes": state_bytes, "step_messages": step_messages}

    def judge(self, case, records, complete=True):
        if not complete:
            return []
        G = case.world_size
        size = records[0]["initial"].numel()
        shards = data.chunk_sizes(size, G)
        problems = []
        for rank, record in enumerate(records):
            values = record["parameters"]
            if not isinstance(values, list) or len(values) != STEPS or \
                    not all(isinstance(v, torch.Tensor) and v.numel() == size for v in values):
                return [Problem(f"rank {rank}'s flat parameters changed shape: update flat_params in place.",
                                order=(0, rank), line="training")]
        for rank, record in enumerate(records):
            full, mine = 4 * size, 4 * shards[rank]
            held = record["state_bytes"]
            if not isinstance(held, int) or held <= 0:
                problems.append(Problem(f"rank {rank} returned no optimizer-state tensor: return step, [momentum "
                                        "buffer of your shard], so the check can count its bytes.", order=(-1, rank),
                                        line="shard"))
                break
            if G > 1 and held > 1.5 * mine + 64:
                problems.append(Problem(
                    f"rank {rank}'s optimizer state holds {held} bytes" + (f", the momentum of all N = {size} parameters "
                                                                          f"(4 N = {full})" if held == full else "")
                    + f": ZeRO-1 keeps only its shard's, 4 |shard {rank}| = {mine} bytes, about 1/G of it. Update only "
                      f"torch.tensor_split(flat, G)[{rank}], then all-gather.", order=(-1, rank), line="shard"))
                break
        problems += self._gather_problems(case, records, shards)
        problems += self._training_problems(case, records, shards)
        return problems

    def _gather_problems(self, case, records, shards):
        """Every rank sends at least one message per step that carries updated parameters (its shard after the
        update): the all-gather moves parameters, not gradient sums."""
        G = case.world_size
        if G < 2:
            return []
        for step in range(STEPS):
            for rank, record in enumerate(records):
                first, last = record["step_messages"][step]
                sends = [m for m in record["messages"][first:last] if m.is_send and m.data is not None and m.numel]
                # the rank's own parameters after and before the step: a piece of the new ones that was not there
                # before is an updated shard, whether or not the update was right (that is the 'training' line)
                after = record["parameters"][step].double()
                before = (record["initial"] if step == 0 else record["parameters"][step - 1]).double()
                reference = record["reference"][step].double()
                if not any((_is_part_of(m.data.double(), after) or _is_part_of(m.data.double(), reference))
                           and not _is_part_of(m.data.double(), before) for m in sends):
                    total = sum(m.numel for m in sends)
                    return [Problem(
                        f"step {step}: no message rank {rank} sent carried updated parameters ({len(sends)} messages, "
                        f"{total} elements): ZeRO-1 all-gathers the shards after each rank updated its own, so every "
                        "rank's shard of new parameters must travel to the others.", order=(step, 2, rank),
                        line="gather")]
        return []

    def _training_problems(self, case, records, shards):
        G = case.world_size
        for step in range(STEPS):
            for rank, record in enumerate(records):
                got, want = record["parameters"][step].double(), record["reference"][step].double()
                gap = (got - want).abs()
                if bool((gap <= 1e-5).all()):
                    continue
                index = int((gap > 1e-5).nonzero()[0])
                chunk = _chunk_of(index, shards)
                before = (record["initial"] if step == 0 else record["parameters"][step - 1]).double()
                piece = torch.tensor_split(got, G)[chunk]
                wanted = torch.tensor_split(want, G)
                other = next((j for j in range(G) if j != chunk and wanted[j].numel() == piece.numel()
                              and bool(((wanted[j] - piece).abs() <= 1e-5).all())), None)
                if torch.equal(piece, torch.tensor_split(before, G)[chunk]):
                    why = (f" Slot {chunk} still holds the values before the step: rank {chunk}'s updated shard never "
                           "reached it (or went to another slot).")
                elif other is not None:
                    why = (f" Slot {chunk} holds shard {other}'s updated values: the all-gather put rank {other}'s shard "
                           f"where rank {chunk}'s belongs (shard r goes to torch.tensor_split(flat, G)[r]).")
                else:
                    why = ""
                return [Problem(f"after step {step} rank {rank}'s parameters differ from plain data parallelism (one "
                                f"process, SGD with momentum {MOMENTUM}) by up to {gap.max().item():.3g}, first in shard "
                                f"{chunk}." + why, order=(step, 3, rank), line="training")]
        return []


def _is_part_of(piece, whole, tol=1e-5) -> bool:
    """True when `piece` equals some contiguous run of `whole` (within tol)."""
    n = piece.numel()
    if n == 0 or n > whole.numel():
        return False
    windows = whole.unfold(0, n, 1)
    return bool(((windows - piece).abs().max(dim=1).values <= tol).any())


def _chunk_of(index, sizes) -> int:
    offset = 0
    for chunk, size in enumerate(sizes):
        if index < offset + size:
            return chunk
        offset += size
    return len(sizes) - 1


SINGLE = RubricLine("single", "with one rank (G = 1) training is one process's", 1, family=SINGLE_RANK)

register(OverlappedBuckets(
    name="overlapped_buckets", notebook="11_beat_the_ring", points=10,
    signature="overlapped_buckets(buckets, start_allreduce) -> finish",
    summary="gradient hooks that start each bucket's non-blocking all-reduce the moment its last gradient is "
            "ready; finish() waits for them after backward, before the step, and writes the mean into .grad",
    rubric=(RubricLine("overlap", "every bucket's all-reduce starts from a gradient hook, after its last gradient is "
                                  "ready and before backward returns, and none is waited for inside backward", 3),
            RubricLine("wait", "finish() waits for every bucket after backward, before optimizer.step()", 1),
            RubricLine("mean", "after finish() every rank's gradients are the mean over the ranks (each bucket all-reduced "
                               "once per step, divided by G)", 3),
            RubricLine("exchange", "the gradients travel: at least n(G - 1)/G of the n values received per step", 1),
            RubricLine("training", "the parameters after every step equal one process training on the whole global "
                                   "batch (within 1e-5)", 1),
            SINGLE),
    forbidden=("collectives", "training")))

register(Zero1Step(
    name="zero1_step", notebook="11_beat_the_ring", points=10,
    signature="zero1_step(flat_params, momentum) -> (step, state)",
    summary="ZeRO-1 with SGD and momentum: step(flat_grad) reduce-scatters the gradient, updates this rank's shard "
            "(keeping only that shard's momentum) and all-gathers the parameters",
    rubric=(RubricLine("training", "the parameters after every step equal plain data parallelism (one process, SGD with "
                                   "momentum 0.9, whole global batches), within 1e-5", 4),
            RubricLine("shard", "each rank's optimizer state is its shard's momentum only: about 4 N / G bytes, not 4 N",
                       2.5),
            RubricLine("gather", "every step, every rank sends its updated shard of parameters (the all-gather moves "
                                 "parameters, not gradient sums)", 2.5),
            SINGLE),
    forbidden=("collectives", "allreduce", "fast_allreduce", "training")))
