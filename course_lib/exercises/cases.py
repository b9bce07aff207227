"""The cases every function exercise runs, and the helpers their `run_case` shares.

Visible cases (``check(name, fn)``), for G = 1, 2, 3, 4, 5, 8:
    tagged data, N = 2G + 1 (not a multiple of G: the chunks differ in length)
    random data, N = 3G + 2
    tagged data, N = 4G (divides evenly: the core case most rubric lines are judged on)
Hidden cases (``hidden=True``, what the grader runs) add G = 6 and 7 and, for every G > 1:
    tagged, N = G - 1 (fewer elements than ranks: one chunk is empty)
    random, N = 1 and N = 200 + G, other seeds
Rooted exercises (broadcast, parameter server) use root G - 1 for the tagged cases, 0 for the random
ones, and G // 2 in the hidden ones, so a solution that always uses rank 0 is caught.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


__all__ = ["Case", "standard_cases", "VISIBLE_SIZES", "HIDDEN_SIZES", "portable", "clone"]

@dataclass(frozen=True)
class Case:
    """One run of a learner's function on `world_size` ranks.

    Attributes:
        world_size: G, the number of ranks.
        numel: N, elements per rank.
        data: 'tagged' (every value says which ranks and which chunk it came from, see
            `course_lib.viz.tag`: exact, readable feedback) or 'random' (floats like a gradient,
            compared with a tolerance for summation order).
        seed: varies the random data.
        root: src / root for rooted exercises, else None.
        hidden: a case only the grader runs (``check(..., hidden=True)``).
    """

    world_size: int
    numel: int
    data: str = "tagged"
    seed: int = 0
    root: int | None = None
    hidden: bool = False

    def label(self, root_name: str = "root") -> str:
        text = f"G={self.world_size}, N={self.numel}, {self.data}"
        if self.root is not None:
            text += f", {root_name}={self.root}"
        return text


VISIBLE_SIZES = (1, 2, 3, 4, 5, 8)
HIDDEN_SIZES = (6, 7)


def standard_cases(hidden: bool = False, rooted: bool = False, min_numel: int = 0) -> list[Case]:
    """The cases described in this module's docstring, tagged ones first within each world size."""
    cases = []
    sizes = VISIBLE_SIZES + (HIDDEN_SIZES if hidden else ())
    for G in sorted(sizes):
        extra = G in HIDDEN_SIZES
        root = (lambda r: r) if rooted else (lambda r: None)
        cases.append(Case(G, 2 * G + 1, "tagged", 0, root(G - 1), hidden=extra))
        if G == 1:
            continue
        cases.append(Case(G, 3 * G + 2, "random", 1, root(0), hidden=extra))
        if hidden:
            cases.append(Case(G, max(G - 1, min_numel), "tagged", 0, root(G // 2), hidden=True))
        cases.append(Case(G, 4 * G, "tagged", 0, root(0), hidden=extra))
        if hidden:
            cases += [Case(G, max(1, min_numel), "random", 2, root(G - 1), hidden=True),
                      Case(G, 200 + G, "random", 3, root(G // 2), hidden=True)]
    return cases


def clone(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().clone()


def portable(value, depth: int = 0):
    """What a learner's function returned, in a form that survives the trip back from the rank:
    numbers and strings as they are, tensors as CPU copies, lists and tuples element by element,
    anything else as a short description."""
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    if isinstance(value, torch.Tensor):
        return clone(value)
    if isinstance(value, (list, tuple)) and depth < 2:
        return type(value)(portable(v, depth + 1) for v in value)
    if hasattr(value, "__index__"):
        try:
            return int(value.__index__())
        except Exception:  # noqa: BLE001
            pass
    return f"<a {type(value).__name__}>"
