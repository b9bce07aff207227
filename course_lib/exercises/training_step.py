"""Notebook 07: the data-parallel step.

    average_gradients(model) -> None
        Called on every rank right after ``loss.backward()``: each parameter's ``.grad`` holds the
        gradient of this rank's mean loss over its own batch (every rank's batch has the same size).
        Afterwards every rank's ``.grad`` must hold the mean over all ranks, in place (or assigned).

The check trains a small MLP for three steps on G ranks, each rank on its slice of every global
batch, calling the learner's function between backward and ``optimizer.step()``; then it compares
(1) each rank's gradients with the mean of all ranks' local gradients, step by step, and (2) the
parameters after every step with one process training on the whole global batches (`train_single_process`),
which is the claim of notebook 07. The built-in collectives and course_lib.training's own
`average_gradients` are off limits; course_lib.allreduce, course_lib.collectives and the learner's own
ring from notebook 05 are allowed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from course_lib.exercises.cases import HIDDEN_SIZES, clone
from course_lib.exercises.registry import Case, FunctionExercise, Problem, register

__all__ = ["AverageGradients", "STEPS", "BATCH"]

STEPS, BATCH, LR = 3, 4, 0.5


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


class AverageGradients(FunctionExercise):
    def cases(self, hidden=False):
        import course_lib.training  # noqa: F401 - imported once here, not in every forked rank
        sizes = (1, 2, 3, 4) + ((5, 8) + HIDDEN_SIZES if hidden else ())
        cases = []
        for G in sorted(sizes):
            extra = G not in (1, 2, 3, 4)
            cases.append(Case(G, 0, "tagged", seed=0, hidden=extra))  # 'tagged' = the 123-parameter model
            if hidden and G > 1:
                cases.append(Case(G, 0, "random", seed=1, hidden=True))
        return cases

    def run_case(self, call, case, rank, world_size):
        from course_lib.training.data_parallel import flat_gradient, flat_parameters

        model = _model(case)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        inputs, labels = _dataset(case)
        local, averaged, parameters = [], [], []
        for batch in _global_batches(case):
            mine = batch[rank * BATCH:(rank + 1) * BATCH]
            optimizer.zero_grad()
            F.cross_entropy(model(inputs[mine]), labels[mine]).backward()
            local.append(clone(flat_gradient(model)))
            call(model)
            averaged.append(clone(flat_gradient(model)))
            optimizer.step()
            parameters.append(flat_parameters(model))
        return {"local": local, "averaged": averaged, "parameters": parameters}

    def judge(self, case, records, complete=True):
        if not complete:
            return []
        from course_lib.training.data_parallel import train_single_process

        G = case.world_size
        model = _model(case)
        names = [(name, p.numel()) for name, p in model.named_parameters()]
        eps = torch.finfo(torch.float32).eps
        for step in range(STEPS):
            locals_ = torch.stack([record["local"][step].double() for record in records])
            mean = locals_.mean(0)
            tol = (G + 2) * eps * locals_.abs().sum(0) / G + 1e-12
            for rank, record in enumerate(records):
                got = record["averaged"][step].double()
                if got.shape != mean.shape:
                    return [Problem(f"step {step}: rank {rank}'s gradients changed shape.", order=(step, rank))]
                bad = (got - mean).abs() > tol
                if not bool(bad.any()):
                    continue
                index = int(bad.nonzero()[0])
                which = _parameter_at(names, index)
                own = records[rank]["local"][step].double()
                if torch.equal(got, own) and G > 1:
                    text = (f"step {step}: after average_gradients rank {rank}'s gradients are still its own local "
                            "ones: the ranks must exchange them and take the mean.")
                elif G > 1 and bool(((got - G * mean).abs() <= G * tol).all()):
                    text = (f"step {step}: rank {rank} holds the sum of the ranks' gradients, not their mean: divide "
                            f"by the world size, {G}.")
                else:
                    text = (f"step {step}: rank {rank}'s gradient of {which} is {got[index].item():.6g} at one element; "
                            f"the mean over all ranks' gradients is {mean[index].item():.6g}.")
                return [Problem(text, order=(step, rank))]
        # The claim of the lesson: G ranks train exactly like one process on the whole global batches.
        reference_model = _model(case)
        inputs, labels = _dataset(case)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # a tiny model; and no OpenMP pool in this process for later forks to trip on
        try:
            reference = train_single_process(reference_model, torch.optim.SGD(reference_model.parameters(), lr=LR),
                                             (inputs, labels), F.cross_entropy, batches=_global_batches(case),
                                             record_parameters=True)
        finally:
            torch.set_num_threads(threads)
        for step in range(STEPS):
            for rank, record in enumerate(records):
                gap = (record["parameters"][step] - reference.parameters[step + 1]).abs().max().item()
                if gap > 1e-5:
                    return [Problem(f"after step {step} rank {rank}'s parameters differ from one process training on "
                                    f"the whole global batch by up to {gap:.3g}.", order=(STEPS, step, rank))]
        return []


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
    checks=("three SGD steps of a small MLP on G = 1 to 4 ranks (more in the hidden cases), equal batches per rank",
            "after your function every rank's gradients equal the mean of all ranks' local gradients (float tolerance)",
            "the parameters after every step equal one process training on the whole global batch (within 1e-5)"),
    forbidden=("training",)))
