"""Notebook 07: the data-parallel step.

    average_gradients(model) -> None
        Called on every rank right after ``loss.backward()``: each parameter's ``.grad`` holds the
        gradient of this rank's mean loss over its own batch (every rank's batch has the same size).
        Afterwards every rank's ``.grad`` must hold the mean over all ranks, in place (or assigned).

The check trains a small MLP for three steps on G ranks, each rank on its slice of every global
batch, calling the learner's function between backward and ``optimizer.step()``; the ranks report the
gradients after the learner's function and the parameters after every step. The judge then recomputes
every rank's local gradient itself (from the model's seed, the rank's batch and the parameters it
reported) and compares (1) each rank's gradients with the mean of all ranks' local gradients, step by
step, and (2) the parameters after every step with one process training on the whole global batches
(`train_single_process`), which is the claim of notebook 07. The built-in collectives and
course_lib.training (its own `average_gradients`, DDP, ZeRO, the compression hooks) are off limits;
course_lib.allreduce, course_lib.fast_allreduce, course_lib.collectives and the learner's own ring from
notebook 05 are allowed.

The exchange is judged from the data too: a rank that received fewer elements than an all-reduce of its
gradients needs, or whose received values do not carry the other ranks' gradients (each value must be the
sum of some ranks' gradients at some element, as it is or divided by G or by their count: what a naive
exchange, a parameter server, a ring or a tree sends; `_missing_contributions`), cannot have averaged them
through the messages the check traces. Padding, noise or parameters sent instead, with the mean computed
some other way, earn nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from course_lib.exercises.cases import clone
from course_lib.exercises.registry import Case, FunctionExercise, Problem, register
from course_lib.exercises.rubric import SINGLE_RANK, RubricLine

__all__ = ["AverageGradients", "STEPS", "BATCH", "TRAINING_SIZES", "training_cases"]

STEPS, BATCH, LR = 3, 4, 0.5
TRAINING_SIZES = (1, 2, 3, 4)      # the check's world sizes for the exercises that train a model
MODEL_SEEDS = {"tagged": 0, "random": 1}


def training_cases(model: str, sizes: tuple = TRAINING_SIZES) -> list[Case]:
    """One case per G in `sizes`, all on one model: a case's data names its model ('tagged': the 123-parameter
    MLP, 'random': the 63-parameter one; N is unused), its seed (0 and 1) the model's weights and data."""
    return [Case(G, 0, model, seed=MODEL_SEEDS[model]) for G in sorted(sizes)]


def _model(case):
    from course_lib.training import toy

    hidden = 8 if case.data == "tagged" else 5  # 123 or 63 parameters: not a multiple of most G
    return toy.make_mlp(hidden=hidden, seed=case.seed)


def _dataset(case):
    from course_lib.training import toy

    return toy.make_spirals(STEPS * BATCH * case.world_size, seed=case.seed + 1)


def _global_batches(case):
    G = case.world_size
    return [list(range(step * BATCH * G, (step + 1) * BATCH * G)) for step in range(STEPS)]


class _LocalGradients:
    """Every rank's gradient of its mean loss over its slice of a global batch, at given flat parameters:
    what each rank computed before the learner's function, recomputed on the judge's side."""

    def __init__(self, case):
        self.case, self.model = case, _model(case)
        self.inputs, self.labels = _dataset(case)
        self.batches = _global_batches(case)

    def __call__(self, parameters, rank, step) -> torch.Tensor:
        from course_lib.training.data_parallel import flat_gradient

        torch.nn.utils.vector_to_parameters(parameters.to(torch.float32), self.model.parameters())
        self.model.zero_grad(set_to_none=True)
        mine = self.batches[step][rank * BATCH:(rank + 1) * BATCH]
        F.cross_entropy(self.model(self.inputs[mine]), self.labels[mine]).backward()
        return clone(flat_gradient(self.model))


def _one_thread():
    """A context in which torch uses one thread: the ranks do, so the judge's recomputed gradients are theirs bit
    for bit; and no OpenMP pool appears in this process for later forks to trip on."""
    import contextlib

    @contextlib.contextmanager
    def scope():
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)
    return scope()


class AverageGradients(FunctionExercise):
    observed = ("averaged", "parameters")

    def cases(self):
        import course_lib.training  # noqa: F401 - imported once here, not in every forked rank
        return training_cases("tagged")

    def inputs(self, case):
        return [None] * case.world_size          # the model and the data are made from the case's seeds

    def oracle(self, case, inputs):
        from course_lib.training.data_parallel import flat_parameters, train_single_process

        model = _model(case)
        initial = flat_parameters(model)
        data_x, data_y = _dataset(case)
        with _one_thread():
            log = train_single_process(model, torch.optim.SGD(model.parameters(), lr=LR), (data_x, data_y),
                                       F.cross_entropy, batches=_global_batches(case), record_parameters=True)
        facts = {"initial": initial, "reference": [p.clone() for p in log.parameters[1:STEPS + 1]]}
        return [dict(facts) for _ in range(case.world_size)]

    def run_case(self, call, case, rank, world_size, inputs):
        from course_lib.training.data_parallel import flat_gradient, flat_parameters

        model = _model(case)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        data_x, data_y = _dataset(case)
        averaged, parameters = [], []
        for batch in _global_batches(case):
            mine = batch[rank * BATCH:(rank + 1) * BATCH]
            optimizer.zero_grad()
            F.cross_entropy(model(data_x[mine]), data_y[mine]).backward()
            call(model)
            averaged.append(clone(flat_gradient(model)))
            optimizer.step()
            parameters.append(flat_parameters(model))
        return {"averaged": averaged, "parameters": parameters}

    def judge(self, case, records, complete=True):
        if not complete:
            return []
        G = case.world_size
        names = [(name, p.numel()) for name, p in _model(case).named_parameters()]
        size = sum(numel for _, numel in names)
        for rank, record in enumerate(records):
            for key in ("averaged", "parameters"):
                values = record[key]
                if (not isinstance(values, list) or len(values) != STEPS
                        or not all(isinstance(v, torch.Tensor) and v.numel() == size for v in values)):
                    return [Problem(f"rank {rank}'s {'gradients' if key == 'averaged' else 'parameters'} changed shape: "
                                    f"average_gradients must leave every .grad the shape of its parameter.",
                                    order=(0, rank), line="mean")]
        with _one_thread():
            local_gradients = self._local_gradients(case, records)
        problems = self._mean_problems(case, records, names, local_gradients) + self._training_problems(case, records)
        mean_right = not any(p.line == "mean" for p in problems)
        received = [sum(m.numel for m in record["messages"] if not m.is_send) for record in records]
        needed = STEPS * size * (G - 1) / G
        short = [rank for rank, count in enumerate(received) if count < needed]
        if G > 1 and short:
            rank = short[0]
            problems.append(Problem(
                f"rank {rank} received {received[rank]} elements in {STEPS} steps; an all-reduce of the {size} gradient "
                f"values needs at least {size}(G - 1)/G per step ({needed:g} in all)"
                + (": the mean it holds did not come through the point-to-point messages the check traces."
                   if mean_right else ": every rank must send and receive its part of the gradients."),
                order=(-1, rank), line=None if mean_right else "exchange"))
        elif G > 1:
            missing = _missing_contributions(records, local_gradients)
            if missing is not None:
                rank, step, element, others, share = missing
                which = _parameter_at(names, element)
                problems.append(Problem(
                    f"step {step}: no message rank {rank} received carried the gradients of {others} for "
                    f"{share:.0%} of the values it needed them for (e.g. {which}): what the ranks send must be "
                    "their gradients, or sums of them, not other values"
                    + (", so the mean it holds did not come through the point-to-point messages the check traces."
                       if mean_right else "."),
                    order=(-1, rank), line=None if mean_right else "exchange"))
        return problems

    def _local_gradients(self, case, records) -> list:
        """[step] -> a (G, n) float64 tensor: every rank's own gradient at that step, recomputed here at the
        parameters the rank reported (what each rank computed before the learner's function)."""
        local_gradient = _LocalGradients(case)
        steps = []
        for step in range(STEPS):
            before = [record["initial"] if step == 0 else record["parameters"][step - 1] for record in records]
            steps.append(torch.stack([local_gradient(before[rank], rank, step).double()
                                      for rank in range(case.world_size)]))
        return steps

    def _mean_problems(self, case, records, names, local_gradients):
        """Step by step, every rank's gradients after the learner's function against the mean of the ranks' own
        local gradients, recomputed here at the parameters each rank reported."""
        G = case.world_size
        eps = torch.finfo(torch.float32).eps
        for step in range(STEPS):
            locals_ = local_gradients[step]
            mean = locals_.mean(0)
            tol = (G + 2) * eps * locals_.abs().sum(0) / G + 1e-12
            for rank, record in enumerate(records):
                got = record["averaged"][step].double().reshape(-1)
                bad = ~((got - mean).abs() <= tol)          # NaN is never the mean
                if not bool(bad.any()):
                    continue
                index = int(bad.nonzero()[0])
                which = _parameter_at(names, index)
                if torch.equal(got, locals_[rank]) and G > 1:
                    text = (f"step {step}: after average_gradients rank {rank}'s gradients are still its own local "
                            "ones: the ranks must exchange them and take the mean.")
                elif G > 1 and bool(((got - G * mean).abs() <= G * tol).all()):
                    text = (f"step {step}: rank {rank} holds the sum of the ranks' gradients, not their mean: divide "
                            f"by the world size, {G}.")
                else:
                    text = (f"step {step}: rank {rank}'s gradient of {which} is {got[index].item():.6g} at one element; "
                            f"the mean over all ranks' gradients is {mean[index].item():.6g}.")
                return [Problem(text, order=(step, rank), line="mean")]
        return []

    def _training_problems(self, case, records):
        """The claim of the lesson: G ranks train exactly like one process on the whole global batches."""
        for step in range(STEPS):
            for rank, record in enumerate(records):
                gap = (record["parameters"][step].double() - record["reference"][step].double()).abs().max().item()
                if not gap <= 1e-5:
                    return [Problem(f"after step {step} rank {rank}'s parameters differ from one process training on "
                                    f"the whole global batch by up to {gap:.3g}.", order=(STEPS, step, rank),
                                    line="training")]
        return []


_WINDOW = 32           # candidates looked at on each side of where a received value sorts in
_MISSING_SHARE = 0.1    # a rank may lack the contributions of others for this share of its values (float coincidences)


def _candidates(gradients: torch.Tensor):
    """Every value a correct exchange of these gradients can put in a message, one per (subset S of the ranks,
    element i): the sum of S's gradients at i, as it is or divided by G or by |S| (averaging on the way).

    Returns (values, tolerances, subsets as bit masks, elements), sorted by value, as numpy arrays.
    """
    import numpy as np

    G, n = gradients.shape
    L = gradients.numpy()
    sums, sizes = np.zeros((1 << G, n)), np.zeros(1 << G, dtype=np.int64)
    abs_sums = np.zeros((1 << G, n))
    for mask in range(1, 1 << G):
        low = (mask & -mask).bit_length() - 1                 # built from the subset without its lowest rank
        sums[mask], abs_sums[mask] = sums[mask ^ (1 << low)] + L[low], abs_sums[mask ^ (1 << low)] + np.abs(L[low])
        sizes[mask] = sizes[mask ^ (1 << low)] + 1
    masks = np.repeat(np.arange(1, 1 << G), n)
    elements = np.tile(np.arange(n), (1 << G) - 1)
    eps = float(torch.finfo(torch.float32).eps)
    values, tolerances, subsets, where = [], [], [], []
    scales = [np.ones(sizes[1:].shape), np.full(sizes[1:].shape, 1.0 / G), 1.0 / sizes[1:]]
    for scale in scales:
        per = np.repeat(scale, n)
        values.append(sums[1:].reshape(-1) * per)
        tolerances.append((np.repeat(sizes[1:], n) + 2) * eps * abs_sums[1:].reshape(-1) * per + 1e-30)
        subsets.append(masks)
        where.append(elements)
    values, tolerances = np.concatenate(values), np.concatenate(tolerances)
    subsets, where = np.concatenate(subsets), np.concatenate(where)
    order = np.argsort(values, kind="stable")
    return values[order], tolerances[order], subsets[order], where[order]


def _missing_contributions(records, local_gradients):
    """Whether the gradients of the other ranks reached each rank through the messages it received.

    A rank's mean needs, at every element, the gradient of every other rank whose gradient is not 0 there (not
    within float rounding of 0). A
    received value carries the contributions of the ranks S when it equals the sum of S's gradients at some
    element (or that sum divided by G or |S|): what a naive exchange, a parameter server, a ring or a tree
    sends. Padding, parameters or noise carry nothing. Judged only from the data: the values the other ranks
    sent to this rank, against the gradients the judge recomputed.

    Returns None when every rank got (nearly) every contribution it needs at every step; else (rank, step, an
    element it lacked, whose contributions in words, the share of its needed values that lacked some).
    """
    import numpy as np

    G = len(records)
    incoming = [[] for _ in range(G)]
    for sender, record in enumerate(records):
        for message in record["messages"]:
            if message.is_send and message.data is not None and message.peer in range(G) and message.peer != sender:
                incoming[message.peer].append(message.data.double().reshape(-1).numpy())
    for step, gradients in enumerate(local_gradients):
        values, tolerances, subsets, elements = _candidates(gradients)
        # A contribution within float rounding of 0 cannot show in a sum: only the others are needed.
        L = gradients.numpy()
        rounding = (len(records) + 2) * float(torch.finfo(torch.float32).eps) * np.abs(L).sum(0)
        nonzero = np.abs(L) > rounding
        for rank in range(G):
            need = np.zeros(gradients.shape[1], dtype=np.int64)
            for other in range(G):
                if other != rank:
                    need |= nonzero[other].astype(np.int64) << other
            have = np.zeros_like(need)
            got = np.unique(np.concatenate(incoming[rank])) if incoming[rank] else np.zeros(0)
            got = got[np.isfinite(got) & (got != 0)]
            if got.size:
                # The candidates next to where each value sorts in: a value matches within its rounding.
                index = np.searchsorted(values, got)[:, None] + np.arange(-_WINDOW, _WINDOW)[None, :]
                index = np.clip(index, 0, values.size - 1)
                match = np.abs(values[index] - got[:, None]) <= tolerances[index]
                np.bitwise_or.at(have, elements[index[match]], subsets[index[match]])
            lacking = need & ~have
            needed = int((need != 0).sum())
            short = np.nonzero(lacking)[0]
            if needed and short.size > _MISSING_SHARE * needed:
                element = int(short[0])
                ranks = [other for other in range(G) if lacking[element] >> other & 1]
                who = ", ".join(f"rank {other}" for other in ranks[:3]) + (" and others" if len(ranks) > 3 else "")
                return rank, step, element, who, short.size / needed
    return None


def _parameter_at(names, index) -> str:
    offset = 0
    for name, numel in names:
        if index < offset + numel:
            return name
        offset += numel
    return "a parameter"


register(AverageGradients(
    name="average_gradients", notebook="07_data_parallel_training", points=10,
    signature="average_gradients(model) -> None",
    summary="after backward on every rank, replace every parameter's .grad by the mean over all ranks",
    rubric=(RubricLine("exchange", "every rank sends and receives its part of the gradients: at least n(G - 1)/G of "
                                   "the n gradient values per step, carrying the other ranks' gradients or sums of "
                                   "them (three SGD steps of a small MLP, equal batches)", 3),
            RubricLine("mean", "after your function every rank's gradients equal the mean of all ranks' local "
                               "gradients, at every step (float tolerance)", 5),
            RubricLine("training", "the parameters after every step equal one process training on the whole global "
                                   "batch (within 1e-5)", 1),
            RubricLine("single", "with one rank (G = 1) the gradients stay as they are", 1, family=SINGLE_RANK)),
    forbidden=("training",)))
