"""Rubric files: an instructor's re-weighting of the rubric lines, and the defaults written out as one.

    weights = load_weights("rubric.toml")    # {'ring_scatter_reduce': {'returned': 1.0, 'uneven': 2.0}}
    print(defaults_toml())                   # every exercise's lines and their default points

A file is TOML or JSON; a line set to 0 is dropped; what it leaves out keeps its default points. The
rules a line follows are `course_lib.exercises.rubric`'s.
"""

from __future__ import annotations

import difflib
import json
import pathlib

from course_lib.exercises import registry
from course_lib.exercises.report import format_points

__all__ = ["load_weights", "defaults_toml", "RubricFileError"]


class RubricFileError(ValueError):
    """A rubric file that cannot be used: what is wrong, where, and how to write it instead."""


def _parse(path: pathlib.Path) -> dict:
    text = path.read_text()
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise RubricFileError(f"{path}: not valid JSON ({exc})") from None
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise RubricFileError(f"{path}: reading TOML needs Python 3.11 or the tomli package; "
                                  "write the file as JSON instead ({\"ring\": {\"values\": 2}})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RubricFileError(f"{path}: not valid TOML ({exc})") from None


def load_weights(path) -> dict:
    """Read an instructor's rubric file: {exercise name: {line key: points}}.

    The file is TOML (``[ring_scatter_reduce]`` then ``returned = 1``) or JSON (``{"ring_scatter_reduce":
    {"returned": 1}}``). A line set to 0 is dropped; lines and exercises left out keep their default points
    (`defaults_toml`, or docs/rubric.toml).

    Raises:
        RubricFileError: a name that is no exercise or no line of it, or points that are not a number >= 0.

    Example::

        >>> load_weights("rubric.toml")
        {'ring_scatter_reduce': {'returned': 1.0, 'uneven': 2.0}}
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise RubricFileError(f"no rubric file at {path}")
    table = _parse(path)
    if not isinstance(table, dict):
        raise RubricFileError(f"{path}: expected a table of exercises, each a table of lines and points")
    known = {e.name: e for e in registry.all_exercises(include_pending=True)}
    weights: dict = {}
    for name, lines in table.items():
        if name not in known:
            close = difflib.get_close_matches(name, list(known), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise RubricFileError(f"{path}: there is no exercise called {name!r}.{hint} "
                                  "`python -m course_grader --rubric-defaults` lists every exercise and line.")
        if not isinstance(lines, dict):
            raise RubricFileError(f"{path}: {name} must be a table of line = points, e.g. [{name}] then values = 2")
        keys = [line.key for line in known[name].rubric]
        weights[name] = {}
        for key, points in lines.items():
            if key not in keys:
                raise RubricFileError(f"{path}: exercise {name!r} has no rubric line {key!r}; its lines are "
                                      f"{', '.join(keys)}")
            if isinstance(points, bool) or not isinstance(points, (int, float)) or not points >= 0:
                raise RubricFileError(f"{path}: {name}.{key} = {points!r}: points must be a number >= 0 (0 drops the line)")
            weights[name][key] = float(points)
    return weights


def defaults_toml() -> str:
    """Every exercise's rubric lines with their default points, as a rubric file (docs/rubric.toml)."""
    out = ["# course_lib's rubric: every exercise's lines and their default points. Written by",
           "# `python -m course_grader --rubric-defaults`; a test keeps docs/rubric.toml equal to it.",
           "#",
           "# To re-weight: copy this file, change the numbers (0 drops a line), delete what you keep as it is,",
           "# and grade with `python -m course_grader --rubric my_rubric.toml ...`. An exercise is worth the",
           "# sum of its lines. A family line (marked so) is about one family of cases; the others are judged on",
           "# the remaining cases; see course_lib/exercises/rubric.py for the rule.", ""]
    for exercise in registry.all_exercises(include_pending=True):
        pending = " (its cells are not in the notebook yet)" if registry.is_pending(exercise) else ""
        out.append(f"[{exercise.name}]   # {exercise.notebook}, {format_points(exercise.points)} "
                   f"point{'s' if exercise.points != 1 else ''}{pending}")
        width = max(len(line.key) for line in exercise.rubric)
        for line in exercise.rubric:
            family = f" [family: {line.family.name}]" if line.family else ""
            out.append(f"{line.key:<{width}} = {format_points(line.points):<4} # {line.text}{family}")
        out.append("")
    return "\n".join(out)
