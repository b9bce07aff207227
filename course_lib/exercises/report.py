"""What `check` returns: a score, the feedback, and a report for the notebook.

The score is the sum of the rubric lines met (`rubric.evaluate_cases`); the text form lists every line, met or
missed with its points, when the exercise is not fully right. The text form (``repr``) is short and the same on
every run: no timings, no addresses, no paths, so nbval can compare it. The HTML form adds the rubric, a table
of the cases, and for the ring exercises a picture of the first step that went wrong next to what the ring
does in that step.
"""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass, field

from course_lib.exercises.rubric import evaluate_cases, evaluate_met

__all__ = ["Result", "format_points", "rubric_text"]


def _points_word(max_points: float) -> str:
    """'point' for an exercise worth 1, else 'points': '1/1 point', '0/1 point', '3/5 points'."""
    return "point" if max_points == 1 else "points"


def format_points(value: float) -> str:
    """10 -> '10', 7.5 -> '7.5', 6.3636 -> '6.36'."""
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return text or "0"


def rubric_text(lines) -> list[str]:
    """The rubric as text lines: 'met     2/2  key: text', 'MISSED  0/2  key: text' and, under a missed line, why."""
    out = ["Rubric:"]
    width = max(len(f"{format_points(l.points)}/{format_points(l.max_points)}") for l in lines)
    for line in lines:
        mark = "met" if line.met else "MISSED" if line.tested else "n/a"
        points = f"{format_points(line.points)}/{format_points(line.max_points)}"
        out.append(f"  {mark:<6}  {points:>{width}}  {line.key}: {line.text}")
        if not line.met and line.evidence:
            evidence = line.evidence if len(line.evidence) <= 160 else line.evidence[:157] + "..."
            out.append(f"  {'':<6}  {'':>{width}}  ({evidence})")
    return out


@dataclass
class Result:
    """The outcome of ``exercises.check(name, answer)``.

    Attributes:
        name: the exercise.
        score, max_score: points earned and possible: the sum of the rubric lines met, and of all lines.
        status: 'passed', 'failed' or 'not done'.
        feedback: the report as a list of lines (the first problem first).
        cases: for function exercises, one `runner.CaseResult` per case (empty for questions).
        checks: what the exercise checks, one line each (its rubric lines' texts).
        hidden: whether the grader's hidden cases were included.
        lines: one `rubric.LineResult` per rubric line: met or missed, its points, and why it was missed.
    """

    name: str
    score: float
    max_score: float
    status: str
    feedback: list = field(default_factory=list)
    cases: list = field(default_factory=list)
    checks: tuple = ()
    hidden: bool = False
    _exercise: object = field(default=None, repr=False)
    lines: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def __bool__(self) -> bool:
        return self.passed

    def __repr__(self) -> str:
        return "\n".join(self.feedback)

    def to_dict(self) -> dict:
        """Gradescope's per-test fields (name, score, max_score, output) and the rubric lines."""
        return {"name": self.name, "score": self.score, "max_score": self.max_score, "output": repr(self),
                "lines": [line.to_dict() for line in self.lines]}

    # -- building -------------------------------------------------------------------------------------

    @classmethod
    def not_done(cls, exercise, message: str, weights: dict | None = None) -> "Result":
        lines = evaluate_met(exercise.rubric, (), weights, evidence="not done yet")
        possible = sum(line.max_points for line in lines)
        return cls(exercise.name, 0.0, possible, "not done",
                   [f"{exercise.name}: 0/{format_points(possible)} {_points_word(possible)}, {message}"],
                   checks=exercise.checks, _exercise=exercise, lines=lines)

    @classmethod
    def of_question(cls, exercise, right: bool, message: str, met=(), weights: dict | None = None) -> "Result":
        """A question's result: every line when `right`, else the lines in `met` (what a known slip got right)."""
        keys = [line.key for line in exercise.rubric] if right else list(met)
        lines = evaluate_met(exercise.rubric, keys, weights, evidence=message)
        points = round(sum(line.points for line in lines), 2)
        possible = sum(line.max_points for line in lines)
        head = f"{exercise.name}: {format_points(points)}/{format_points(possible)} {_points_word(possible)}, {message}"
        feedback = [head] + (rubric_text(lines) if not right and len(lines) > 1 else [])
        return cls(exercise.name, points, possible, "passed" if right else "failed", feedback, _exercise=exercise,
                   lines=lines)

    @classmethod
    def of_cases(cls, exercise, cases, hidden: bool, weights: dict | None = None) -> "Result":
        """A function exercise's result from its case results: the rubric lines they earn, and the report."""
        total = len(cases)
        passed = sum(c.passed for c in cases)
        rubric = evaluate_cases(exercise.rubric, cases, weights, exercise.root_name)
        score = round(sum(line.points for line in rubric), 2)
        possible = sum(line.max_points for line in rubric)
        sizes = ", ".join(str(g) for g in sorted({c.case.world_size for c in cases}))
        full = passed == total and all(line.met for line in rubric if line.tested)
        if full:
            lines = [f"{exercise.name}: {format_points(score)}/{format_points(possible)} {_points_word(possible)}, all {total} "
                     f"cases passed (G = {sizes}" + ("; hidden cases included)" if hidden else ")")]
        else:
            lines = [f"{exercise.name}: {format_points(score)}/{format_points(possible)} {_points_word(possible)}, {passed} of "
                     f"{total} cases passed" + (" (hidden cases included)" if hidden else "")]
            lines += rubric_text(rubric)
        lines += exercise.report_lines(cases) if hasattr(exercise, "report_lines") else []
        first = next((c for c in cases if not c.passed), None)
        if first is not None:
            lines.append(f"First problem (case {first.case.label(exercise.root_name)}):")
            lines += ["  " + line for line in first.problems[0].message.splitlines()]
            more = len(first.problems) - 1
            if more:
                lines.append(f"  ({more} more problem{'s' if more != 1 else ''} in this case; fix this one first)")
            lines.append("Cases:")
            for c in cases:
                mark = "passed" if c.passed else ("not run" if c.status == "not run" else "FAILED")
                note = "" if c.passed else ": " + c.problems[0].message.splitlines()[0]
                if len(note) > 140:
                    note = note[:137] + "..."
                lines.append(f"  {mark:<7} {c.case.label(exercise.root_name)}{note}")
        return cls(exercise.name, score, possible, "passed" if full else "failed", lines, cases, exercise.checks,
                   hidden, exercise, rubric)

    # -- HTML -------------------------------------------------------------------------------------------

    def _picture_png(self) -> bytes | None:
        exercise = self._exercise
        if exercise is None or not getattr(exercise, "ring_picture", False):
            return None
        first = next((c for c in self.cases if not c.passed and c.records is not None), None)
        if first is None or not first.problems:
            return None
        try:
            fig = exercise.picture(first.case, first.records, first.problems[0])
        except Exception:  # noqa: BLE001 - a picture is a bonus; the words say it all
            return None
        if fig is None:
            return None
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=80)
        return buffer.getvalue()

    def _repr_html_(self) -> str:
        colour = {"passed": "#1a7f37", "failed": "#b35900", "not done": "#57606a"}[self.status]
        head = html.escape(self.feedback[0]) if self.feedback else html.escape(self.name)
        parts = [f'<div style="border-left:4px solid {colour};padding:4px 10px;margin:4px 0">',
                 f'<div style="font-weight:bold;color:{colour}">{head}</div>']
        failed = [c for c in self.cases if not c.passed]
        if failed:
            first = failed[0]
            message = html.escape(first.problems[0].message)
            parts.append(f"<p>First problem, in the case {html.escape(first.case.label(self._exercise.root_name))}:</p>"
                         f'<pre style="white-space:pre-wrap;margin:0 0 6px 0">{message}</pre>')
            png = self._picture_png()
            if png is not None:
                parts.append('<p>The chunks after that step, read from the values your GPUs sent (left), and what '
                             'the ring does (right):</p>'
                             f'<img src="data:image/png;base64,{base64.b64encode(png).decode()}"/>')
        elif self.status != "passed" and len(self.feedback) > 1:
            parts.append(f"<pre>{html.escape(chr(10).join(self.feedback[1:]))}</pre>")
        table = self._exercise.report_lines(self.cases) if hasattr(self._exercise, "report_lines") and self.cases else []
        if table:
            parts.append(f"<pre>{html.escape(chr(10).join(table))}</pre>")
        if self.cases:
            rows = []
            for c in self.cases:
                symbol = "✓" if c.passed else ("–" if c.status == "not run" else "✗")
                note = "" if c.passed else html.escape(c.problems[0].message.splitlines()[0])
                root = "" if c.case.root is None else str(c.case.root)
                rows.append(f"<tr><td>{symbol}</td><td>{c.case.world_size}</td><td>{c.case.numel}</td>"
                            f"<td>{c.case.data}</td><td>{root}</td><td style='text-align:left'>{note}</td></tr>")
            root_name = html.escape(self._exercise.root_name) if any(c.case.root is not None for c in self.cases) else ""
            parts.append("<details><summary>cases</summary><table><tr><th></th><th>G</th><th>N</th><th>data</th>"
                         f"<th>{root_name}</th><th>first problem</th></tr>" + "".join(rows) + "</table></details>")
        if self.lines and (self.cases or self.status != "passed"):
            rows = "".join(
                f"<tr><td>{'✓' if line.met else '✗' if line.tested else '–'}</td><td>{format_points(line.points)}/{format_points(line.max_points)}"
                f"</td><td style='text-align:left'>{html.escape(line.text)}"
                + ("" if line.met or not line.evidence else f"<br/><small>{html.escape(line.evidence)}</small>")
                + "</td></tr>" for line in self.lines)
            parts.append(f"<details><summary>rubric: {format_points(self.score)}/{format_points(self.max_score)} "
                         f"points</summary><table>{rows}</table></details>")
        parts.append("</div>")
        return "".join(parts)
