"""Notebook 09: a DDP communication hook that averages every gradient bucket with the learner's own ring.

    ring_hook(state, bucket) -> torch.futures.Future

DDP calls ``hook(state, bucket)`` for every bucket of gradients during ``backward()``; ``bucket.buffer()`` is
the bucket's gradients flattened into one 1-D tensor (this rank's: each rank's mean loss over its own batch).
The hook returns a Future holding the bucket averaged over the ranks,

    returned = (1/G) sum_r buffer_r            (every rank, every bucket, every step)

and DDP copies it back into the parameters' ``.grad``. The exercise asks for the average *by your own ring*:
divide by G, then the ring's scatter-reduce and all-gather on the buffer, 2(G-1) messages to the right
neighbour per bucket, and the Future already complete (``fut = torch.futures.Future(); fut.set_result(buffer)``).

The check wraps a small MLP in `DistributedDataParallel` with a tiny `bucket_cap_mb`, so its 63 or 123 gradients
come in several buckets (one bucket in step 0, rebuilt in backward order from step 1 on), registers the hook
(``state`` is None) and trains three SGD steps, every rank on its slice of each global batch. The ranks report
every bucket the hook was handed, what it returned, the messages it sent while it ran, and the parameters
after every step. The judge compares each bucket's result with the mean of the buckets the ranks were handed,
the parameters with one process training on the whole global batches (which the judge trains itself), and
each bucket's messages with a ring's. Built-in collectives, course_lib's all-reduces and course_lib.training
(its `allreduce_hook` is the answer) are off limits.
"""

from __future__ import annotations

import torch

from course_lib.exercises import data
from course_lib.exercises.cases import clone
from course_lib.exercises.registry import FunctionExercise, Problem, register
from course_lib.exercises.rubric import SINGLE_RANK, RubricLine
from course_lib.exercises.training_step import (BATCH, LR, STEPS, _dataset, _global_batches, _model, _one_thread,
                                                training_cases)

__all__ = ["RingHook", "BUCKET_CAP_MB"]

BUCKET_CAP_MB = 0.0001    # 104 bytes: 26 float32 gradients per bucket, so a 63-parameter model has several


class RingHook(FunctionExercise):
    observed = ("calls", "parameters")

    def cases(self):
        return training_cases("random")       # the 63-parameter model, G = 1..4

    def inputs(self, case):
        return [None] * case.world_size              # the model and the data are made from the case's seeds

    def oracle(self, case, inputs):
        from course_lib.training.data_parallel import train_single_process

        model = _model(case)
        data_x, data_y = _dataset(case)
        with _one_thread():
            log = train_single_process(model, torch.optim.SGD(model.parameters(), lr=LR), (data_x, data_y),
                                       torch.nn.functional.cross_entropy, batches=_global_batches(case),
                                       record_parameters=True)
        reference = [p.clone() for p in log.parameters[1:STEPS + 1]]
        return [{"reference": reference} for _ in range(case.world_size)]

    def run_case(self, call, case, rank, world_size, inputs):
        import torch.nn.functional as F
        from torch.nn.parallel import DistributedDataParallel

        from course_lib.training.data_parallel import flat_parameters

        model = _model(case)
        ddp = DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB)   # built outside the learner's call
        calls, step = [], [0]

        def traced_hook(state, bucket):
            before = clone(bucket.buffer())
            first = len(call.messages)
            future = call(state, bucket)
            returned = future.wait() if isinstance(future, torch.futures.Future) else None
            calls.append({"step": step[0], "index": bucket.index(), "before": before,
                          "returned": clone(returned) if isinstance(returned, torch.Tensor) else None,
                          "messages": [first, len(call.messages)]})
            if not isinstance(future, torch.futures.Future):   # DDP would stop the case with a C++ error; the judge
                future = torch.futures.Future()                # says it in the learner's words instead
                future.set_result(bucket.buffer())
            return future

        ddp.register_comm_hook(None, traced_hook)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
        data_x, data_y = _dataset(case)
        parameters = []
        for step[0], batch in enumerate(_global_batches(case)):
            mine = batch[rank * BATCH:(rank + 1) * BATCH]
            optimizer.zero_grad()
            F.cross_entropy(ddp(data_x[mine]), data_y[mine]).backward()
            optimizer.step()
            parameters.append(flat_parameters(model))
        return {"calls": [(c["step"], c["index"], c["before"], c["returned"], tuple(c["messages"])) for c in calls],
                "parameters": parameters}

    def judge(self, case, records, complete=True):
        if not complete:
            return []
        G = case.world_size
        calls = [record["calls"] for record in records]
        if G > 1 and len({len(c) for c in calls}) != 1:
            counts = ", ".join(f"rank {r}: {len(c)}" for r, c in enumerate(calls))
            return [Problem(f"the ranks' hooks ran a different number of times ({counts}): DDP calls the hook once per "
                            "bucket on every rank.", order=(0,))]
        problems = []
        for k in range(len(calls[0])):
            step, index = calls[0][k][0], calls[0][k][1]
            before = [c[k][2] for c in calls]
            mean = torch.stack([b.double() for b in before]).mean(0)
            tol = (G + 2) * torch.finfo(torch.float32).eps * torch.stack([b.double().abs() for b in before]).sum(0) / G \
                + 1e-12
            where = f"step {step}, bucket {index} ({mean.numel()} gradients)"
            for rank, call in enumerate(calls):
                first, last = call[k][4]
                sends = sum(1 for m in records[rank]["messages"][first:last] if m.is_send)
                text = _mean_problem(call[k][3], before[rank], mean, tol, G, rank, where, sends)
                if text is not None:
                    problems.append(Problem(text, order=(1, k, rank), line="mean"))
                    break
            if problems:
                break
            if G > 1:
                text = _ring_problem(records, calls, k, G, where)
                if text is not None:
                    problems.append(Problem(text, order=(2, k), line="ring"))
                    break
        for step in range(STEPS):
            for rank, record in enumerate(records):
                gap = (record["parameters"][step].double() - record["reference"][step].double()).abs().max().item()
                if not gap <= 1e-5:
                    problems.append(Problem(
                        f"after step {step} rank {rank}'s parameters differ from one process training on the whole "
                        f"global batch by up to {gap:.3g}: DDP with your hook must train exactly like it.",
                        order=(3, step, rank), line="training"))
                    return problems
        return problems


def _mean_problem(returned, before, mean, tol, G, rank, where, sends):
    """What is wrong with one rank's hook result for one bucket, in words, or None (`sends`: messages it sent)."""
    if not isinstance(returned, torch.Tensor):
        return (f"{where}: rank {rank}'s hook did not return a completed torch.futures.Future holding a tensor: make "
                "one with fut = torch.futures.Future(), fut.set_result(buffer), and return fut.")
    got = returned.double().reshape(-1)
    if got.shape != mean.shape:
        return (f"{where}: rank {rank}'s hook returned {got.numel()} numbers for a bucket of {mean.numel()}: return "
                "the whole bucket, averaged.")
    close = lambda target, scale=1: bool(((got - target).abs() <= scale * tol).all())  # noqa: E731
    if close(mean):
        return None
    if G > 1 and close(before.double().reshape(-1)):
        return (f"{where}: rank {rank}'s hook returned its own gradients, unchanged: average them over the ranks "
                "(divide by G, then your ring on bucket.buffer()) before returning them.")
    if G > 1 and close(before.double().reshape(-1) / G):
        return (f"{where}: rank {rank}'s hook returned its own gradients divided by G: nothing was exchanged"
                + (" (it sent no message)" if not sends else "") + ". Run your ring on the buffer to sum the ranks' "
                "buckets, then return it.")
    if G > 1 and sends == 4 * (G - 1) and close(G * mean, G):
        return (f"{where}: rank {rank}'s hook returned G times the mean and sent {sends} messages, two ring "
                "all-reduces' worth: the bucket was all-reduced twice. One ring all-reduce per bucket, 2(G-1) messages.")
    if G > 1 and close(G * mean, G):
        return (f"{where}: rank {rank}'s hook returned the sum over the ranks, not the mean: divide by the world size, {G}"
                + (" (dividing by G - 1 = 1 leaves the sum)." if G == 2 else "."))
    if G > 1 and close(G * G * mean, G * G):
        return (f"{where}: rank {rank}'s hook returned G times the sum: the bucket was all-reduced twice (DDP calls "
                "the hook once per bucket; do not all-reduce the parameters' .grad as well).")
    if G > 2 and close(G * mean / (G - 1), G):
        return f"{where}: rank {rank}'s hook divided by G - 1 = {G - 1}; the mean divides by G = {G}."
    if close(mean / G, 1):
        return f"{where}: rank {rank}'s hook divided by G twice: the mean divides the sum by G once."
    bad = int(((got - mean).abs() > tol).nonzero()[0])
    return (f"{where}: rank {rank}'s hook returned {got[bad].item():.6g} at element {bad} of the bucket; the mean over "
            f"the ranks is {mean[bad].item():.6g}.")


def _ring_problem(records, calls, k, G, where):
    """Were bucket k's messages a ring all-reduce? 2(G-1) messages from each rank, to its right neighbour."""
    numel = calls[0][k][2].numel()
    sizes = data.chunk_sizes(numel, G)
    for rank, record in enumerate(records):
        first, last = calls[rank][k][4]
        sends = [m for m in record["messages"][first:last] if m.is_send]
        if not sends:
            return (f"{where}: rank {rank} sent no message while its hook ran: the bucket has to be averaged with your "
                    "ring, by point-to-point messages.")
        wrong = next((m for m in sends if m.peer != (rank + 1) % G), None)
        if wrong is not None:
            return (f"{where}: rank {rank} sent to rank {wrong.peer}; your ring sends only to the right neighbour, rank "
                    f"{(rank + 1) % G} = (r + 1) mod G.")
        if len(sends) == 4 * (G - 1):
            return (f"{where}: rank {rank} sent {len(sends)} messages, two ring all-reduces' worth: DDP calls the hook "
                    f"once per bucket, and one all-reduce of it is 2(G-1) = {2 * (G - 1)} messages.")
        if len(sends) != 2 * (G - 1):
            return (f"{where}: rank {rank} sent {len(sends)} messages; the ring all-reduce of one bucket sends "
                    f"2(G-1) = {2 * (G - 1)}, one per step of each phase.")
        elements = sum(m.numel for m in sends)
        want = 2 * numel - sizes[(rank + 1) % G] - sizes[(rank + 2) % G]
        if elements != want:
            return (f"{where}: rank {rank} sent {elements} elements; the ring sends 2N - |chunk r+1| - |chunk r+2| = "
                    f"{want} for a bucket of N = {numel} (every chunk but one in each phase).")
    return None


register(RingHook(
    name="ring_hook", notebook="09_model_parallelism_and_ddp", points=10,
    signature="ring_hook(state, bucket) -> torch.futures.Future",
    summary="a DDP communication hook: average bucket.buffer() over the ranks with your own ring (divide by G, "
            "scatter-reduce, all-gather) and return a completed Future holding it",
    rubric=(RubricLine("mean", "every bucket DDP hands the hook comes back as the mean over the ranks of that bucket, "
                               "at every step (float tolerance)", 4),
            RubricLine("ring", "each bucket is averaged by a ring: 2(G-1) messages per rank, each to its right "
                               "neighbour, 2N - |chunk r+1| - |chunk r+2| elements for a bucket of N", 2),
            RubricLine("training", "DDP with the hook trains exactly like one process on the whole global batch: the "
                                   "parameters after every step within 1e-5", 3),
            RubricLine("single", "with one rank (G = 1) the bucket comes back as it is", 1, family=SINGLE_RANK)),
    forbidden=("collectives", "allreduce", "fast_allreduce", "training")))
