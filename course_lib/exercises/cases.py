"""The cases every function exercise runs, and the helpers their `run_case` shares.

The standard cases (`standard_cases`), what ``check(name, fn)`` runs, for G = 1, 2, 3, 4, 5, 8:
    tagged data, N = 2G + 1 (not a multiple of G: the chunks differ in length)
    random data, N = 3G + 2
    tagged data, N = 4G (divides evenly: the core case most rubric lines are judged on)
Rooted exercises (broadcast, parameter server) use root G - 1 for the tagged cases and 0 for the random ones.

These are all the cases course_lib has. The grader's hidden cases (more world sizes, lengths, roots and seeds)
are the instructor's: they live in the `course_grader` package (course_grader/hidden_cases.py), not here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


__all__ = ["Case", "standard_cases", "standard_cases_at", "VISIBLE_SIZES", "portable", "clone"]

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
        hidden: a case only the grader runs (course_grader's hidden cases); every case course_lib makes has
            False here.
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


def standard_cases(rooted: bool = False, sizes: tuple = VISIBLE_SIZES) -> list[Case]:
    """The cases described in this module's docstring for every G in `sizes`, one world size after another."""
    return [case for G in sorted(sizes) for case in standard_cases_at(G, rooted)]


def standard_cases_at(world_size: int, rooted: bool = False) -> list[Case]:
    """The standard cases of one world size G, in the order they run: tagged N = 2G + 1, then (for G > 1) random
    N = 3G + 2 and tagged N = 4G."""
    G = world_size
    root = (lambda r: r) if rooted else (lambda r: None)
    if G == 1:
        return [Case(G, 2 * G + 1, "tagged", 0, root(G - 1))]
    return [Case(G, 2 * G + 1, "tagged", 0, root(G - 1)),
            Case(G, 3 * G + 2, "random", 1, root(0)),
            Case(G, 4 * G, "tagged", 0, root(0))]


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
