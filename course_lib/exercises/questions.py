"""The questions the lessons ask: a letter, a number, or a formula in G (ranks) and N (elements per rank).

    check("batch_size_quiz", "B")                 01: the 4-GPU quiz (a letter)
    check("batches_per_epoch", 1)                 01: a number
    check("traffic_naive", "G*(G-1)*N")           03/06: a formula, as a string ...
    check("traffic_naive", lambda G, N: G * (G - 1) * N)   # ... or a function of G and N

A formula string is parsed with `ast` and only arithmetic on numbers, G and N is accepted (no names,
calls or attributes), so nothing a learner types is executed. Implicit products as the course writes
them work too: "2(G-1)N" reads as 2*(G-1)*N, "^" as a power. The formula is evaluated exactly (with
fractions) for G = 1..8, 16, 1024 and several N, and compared with the course's own formula
(`course_lib.viz.traffic_plots.FORMULAS`, which the tests check against measured traffic). Feedback
names the first (G, N) where the answer differs and, for the usual slips (one rank instead of all,
one phase instead of two), says which slip it looks like.

Every question is worth its points through rubric lines: the parts of the reasoning (what one rank sends;
all G ranks together). A known slip (`Slip`) still earns the lines it got right: "(G-1)N" for the naive total
counts one rank correctly and misses "all G ranks together". A formula earns a slip's lines only when it
equals that slip everywhere the check evaluates it.

`grid()` says where a formula is evaluated, so a grader can have a learner's function evaluated in the
learner's process and judge the table of values here (`assess` accepts a function that looks them up).
"""

from __future__ import annotations

import ast
import io
import math
import numbers
import tokenize
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

from course_lib.exercises.registry import Exercise, register
from course_lib.exercises.rubric import RubricLine

__all__ = ["Question", "Slip", "parse_formula", "FormulaError", "POINTS", "NUMELS"]

POINTS = (1, 2, 3, 4, 5, 6, 7, 8, 16, 1024)
NUMELS = (1, 7, 12, 840, 1_000_000)


class FormulaError(ValueError):
    """A formula string that is not arithmetic in G and N."""


# --------------------------------------------------------------------------------------------------
# Formulas, safely
# --------------------------------------------------------------------------------------------------

_ALLOWED_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
                   ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b}
_MAX_EXPONENT = 8


def _implicit_products(text: str) -> str:
    """'2(G-1)N' -> '2*(G-1)*N': insert * where the course's notation leaves it out."""
    text = (text.replace("×", "*").replace("·", "*").replace("−", "-").replace("^", "**")
            .replace("⋅", "*"))
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, IndentationError) as exc:
        raise FormulaError(f"cannot read {text!r}: {exc}") from None
    out, previous = [], None
    for token in tokens:
        starts_operand = token.type in (tokenize.NAME, tokenize.NUMBER) or token.string == "("
        ends_operand = previous is not None and (previous.type in (tokenize.NAME, tokenize.NUMBER) or previous.string == ")")
        if starts_operand and ends_operand:
            out.append("*")
        if token.type not in (tokenize.NEWLINE, tokenize.NL, tokenize.ENDMARKER, tokenize.INDENT, tokenize.DEDENT):
            out.append(token.string)
            previous = token
    return " ".join(out)


def parse_formula(text: str, variables=("G", "N")) -> Callable:
    """Turn a formula string into a function of `variables`, accepting only arithmetic.

    Raises:
        FormulaError: with what is wrong and how to write it instead.
    """
    if not isinstance(text, str):
        raise FormulaError(f"a formula is a string, got {type(text).__name__}")
    if len(text) > 200:
        raise FormulaError("that formula is longer than 200 characters; the answers are short")
    source = _implicit_products(text.strip())
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError:
        raise FormulaError(f"cannot read {text!r} as a formula: write it like 2*(G-1)*N") from None
    aliases = {v.lower(): v for v in variables}

    def evaluate(node, values):
        if isinstance(node, ast.Expression):
            return evaluate(node.body, values)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return Fraction(str(node.value)) if isinstance(node.value, float) else Fraction(node.value)
        if isinstance(node, ast.Name):
            name = node.id if node.id in variables else aliases.get(node.id)
            if name is None:
                raise FormulaError(f"unknown name {node.id!r} in {text!r}: use only {' and '.join(variables)} "
                                   f"(write G*N for a product)")
            return values[name]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = evaluate(node.operand, values)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and type(node.op) in _ALLOWED_BINOPS:
            left, right = evaluate(node.left, values), evaluate(node.right, values)
            if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
                raise ZeroDivisionError
            return _ALLOWED_BINOPS[type(node.op)](left, right)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            base, exponent = evaluate(node.left, values), evaluate(node.right, values)
            if exponent.denominator != 1 or abs(exponent) > _MAX_EXPONENT:
                raise FormulaError(f"in {text!r}: only small whole powers (up to {_MAX_EXPONENT}) are allowed")
            return base ** int(exponent)
        raise FormulaError(f"{text!r} is not plain arithmetic in {' and '.join(variables)}: use numbers, "
                           f"{', '.join(variables)}, + - * / and parentheses")

    # Check the whole tree once, so a bad formula fails at once, not at the first evaluation.
    evaluate(tree, {v: Fraction(3) for v in variables})
    return lambda *args: evaluate(tree, {v: Fraction(a) for v, a in zip(variables, args)})


def _as_fraction(value):
    if isinstance(value, Fraction):
        return value
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return Fraction(int(value))
    if isinstance(value, numbers.Real):
        return Fraction(float(value)) if math.isfinite(float(value)) else None
    try:  # a 0-dim tensor or numpy scalar
        return _as_fraction(value.item())
    except Exception:  # noqa: BLE001
        return None


def _close(a: Fraction, b: Fraction) -> bool:
    return abs(a - b) <= Fraction(1, 10**9) * max(1, abs(b))


def _show(value) -> str:
    if value is None:
        return "nothing usable"
    if value.denominator == 1:
        return f"{value.numerator:,}"
    return f"{float(value):,.6g}"


# --------------------------------------------------------------------------------------------------
# Questions
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Slip:
    """A wrong answer learners often give, what to tell them, and the rubric lines it still gets right.

    Attributes:
        answer: for a formula, a function of (G, N); for a number, a function of nothing computing it.
        hint: a sentence saying what the slip counted.
        met: the keys of the rubric lines the slip still meets.
    """

    answer: Callable
    hint: str
    met: tuple = ()


@dataclass
class Question(Exercise):
    """A question with one right answer.

    Attributes:
        answer_kind: 'formula' (in G and N), 'number', 'choice' (a letter) or 'numbers' (a sequence).
        truth: formula: a function of (G, N); number / numbers / choice: a function of nothing that
            computes the answer (so no answer is stored where code can compute it).
        slips: `Slip`s: wrong answers learners often give, with a hint and the lines they still meet.
        prompt: the question, as the notebook asks it.
        explain: for choice questions, a function(letter) -> feedback for that letter.
        met_by: for choice and numbers questions, a function(answer) -> the keys of the lines it meets.
    """

    answer_kind: str = "formula"
    truth: Callable | None = None
    slips: tuple = ()
    prompt: str = ""
    explain: Callable | None = None
    quantity: str = ""
    met_by: Callable | None = None

    def __post_init__(self):
        super().__post_init__()
        self.kind = "question"

    def grid(self) -> list[tuple[int, int]]:
        """Every (G, N) at which a formula answer is evaluated."""
        return [(G, N) for G in POINTS for N in NUMELS]

    def grade(self, answer) -> tuple[bool, str]:
        """(right?, feedback) for `answer`. Raises NotImplementedError for an answer not given yet."""
        right, message, _ = self.assess(answer)
        return right, message

    def assess(self, answer) -> tuple[bool, str, tuple]:
        """(right?, feedback, keys of the rubric lines met) for `answer`.

        Raises:
            NotImplementedError: for an answer not given yet (None, ``...``).
        """
        if answer is None or answer is Ellipsis:
            raise NotImplementedError
        if self.answer_kind == "formula":
            return self._grade_formula(answer)
        if self.answer_kind == "choice":
            return self._grade_choice(answer)
        if self.answer_kind == "numbers":
            return self._grade_numbers(answer)
        return self._grade_number(answer)

    def _grade_formula(self, answer):
        if isinstance(answer, str):
            try:
                function = parse_formula(answer)
            except FormulaError as exc:
                return False, str(exc) + ".", ()
        elif callable(answer):
            function = answer
        else:
            return False, (f"this question asks for a formula in G and N, as a string such as \"2*(G-1)*N\" or a "
                           f"function of G and N; got {type(answer).__name__} {answer!r}."), ()
        for G, N in self.grid():
            right = Fraction(self.truth(Fraction(G), Fraction(N)))
            try:
                value = _as_fraction(function(G, N))
            except NotImplementedError:
                raise
            except ZeroDivisionError:
                value = None
            except Exception as exc:  # noqa: BLE001 - the learner's function
                return False, f"your answer raised {type(exc).__name__} for G = {G}, N = {N}: {exc}", ()
            if value is not None and _close(value, right):
                continue
            text = (f"for G = {G}, N = {N} your formula gives {_show(value)}; the right count is {_show(right)}"
                    + (f" ({self.quantity})" if self.quantity else "") + ".")
            for slip in self.slips:
                if value is not None and all(_close(value_at(function, g, n), Fraction(slip.answer(Fraction(g), Fraction(n))))
                                             for g, n in ((G, N), (5, 7), (8, 12))):
                    text += " " + slip.hint
                    break
            met = next((slip.met for slip in self.slips
                        if all(_close(value_at(function, g, n), Fraction(slip.answer(Fraction(g), Fraction(n))))
                               for g, n in self.grid())), ())
            return False, text, met
        return True, "right.", ()

    def _grade_choice(self, answer):
        options = self.truth()  # (correct letter, letters)
        correct, letters = options
        if not isinstance(answer, str) or answer.strip().rstrip(".").upper() not in letters:
            return False, f"answer with one of the letters {', '.join(letters)}, as a string (got {answer!r}).", ()
        letter = answer.strip().rstrip(".").upper()
        return letter == correct, self.explain(letter), tuple(self.met_by(letter)) if self.met_by else ()

    def _grade_number(self, answer):
        value = _as_fraction(answer)
        if value is None:
            return False, f"this question asks for a number; got {type(answer).__name__} {answer!r}.", ()
        right = Fraction(self.truth())
        if _close(value, right):
            return True, "right.", ()
        text = f"{_show(value)} is not right" + (f": {self.quantity}." if self.quantity else ".")
        for slip in self.slips:
            if _close(value, Fraction(slip.answer())):
                return False, f"{text} {slip.hint}", slip.met
        return False, text, ()

    def _grade_numbers(self, answer):
        right = [Fraction(v) for v in self.truth()]
        try:
            values = [_as_fraction(v) for v in answer]
        except TypeError:
            return False, f"this question asks for {len(right)} numbers, e.g. a tuple; got {type(answer).__name__}.", ()
        if len(values) != len(right) or any(v is None for v in values):
            return False, f"this question asks for {len(right)} numbers; got {answer!r}.", ()
        if all(_close(v, r) for v, r in zip(values, right)):
            return True, "right.", ()
        total = sum(values)
        hint = " They should add up to 1." if not _close(total, Fraction(1)) and _close(sum(right), Fraction(1)) else ""
        met = tuple(self.met_by(values)) if self.met_by else ()
        return False, f"{tuple(float(v) for v in values)} is not right.{hint}", met


def value_at(function, G, N):
    try:
        return _as_fraction(function(G, N)) or Fraction(0)
    except Exception:  # noqa: BLE001
        return Fraction(-1)


# --------------------------------------------------------------------------------------------------
# The questions of the course
# --------------------------------------------------------------------------------------------------


def _formula(variant, quantity):
    from course_lib.viz.traffic_plots import FORMULAS

    return FORMULAS[(variant, quantity)][0]


# 01: the 4-GPU quiz. Each option claims a factor by which a quantity shrinks on 4 GPUs.
QUIZ_SAMPLES, QUIZ_BATCH, QUIZ_GPUS = 128, 16, 4
QUIZ_OPTIONS = {
    "A": {"time per batch": 1, "batches per epoch": 4, "time per epoch": 1, "overall training time": 4},
    "B": {"time per batch": 1, "batches per epoch": 4, "time per epoch": 4, "overall training time": 4},
    "C": {"time per batch": 4, "batches per epoch": 1, "time per epoch": 4, "overall training time": 4},
}


def quiz_truth(gpus=QUIZ_GPUS, samples=QUIZ_SAMPLES, batch=QUIZ_BATCH):
    """The factors counted: each GPU still processes `batch` samples per step, all GPUs at once."""
    batches_one = math.ceil(samples / batch)
    batches_many = math.ceil(samples / (batch * gpus))
    per_batch = 1  # the same work per GPU per step: a batch of 16 on each
    per_epoch = batches_one // batches_many * per_batch
    return {"time per batch": per_batch, "batches per epoch": batches_one // batches_many,
            "time per epoch": per_epoch, "overall training time": per_epoch}


def _quiz_answer():
    truth = quiz_truth()
    correct = [letter for letter, claims in QUIZ_OPTIONS.items() if claims == truth]
    return correct[0], tuple(QUIZ_OPTIONS)


def _quiz_explain(letter):
    truth = quiz_truth()
    wrong = [what for what, factor in QUIZ_OPTIONS[letter].items() if factor != truth[what]]
    if not wrong:
        return ("right, for the same number of epochs: each batch takes about as long, but there are 4 times fewer "
                "of them per epoch (a 4 times larger global batch may need more epochs, or a larger learning rate).")
    return "not quite: check " + " and ".join(wrong) + "."


def _quiz_lines():
    """One line per claim of the quiz: a letter earns the claims it states right."""
    truth = quiz_truth()
    lines = []
    for what, factor in truth.items():
        change = "stays the same" if factor == 1 else f"is {factor} times smaller"
        lines.append(RubricLine(what.replace(" ", "_"), f"on {QUIZ_GPUS} GPUs: {what} {change}", 1 / len(truth)))
    return tuple(lines)


def _quiz_met(letter):
    truth = quiz_truth()
    return [what.replace(" ", "_") for what, factor in QUIZ_OPTIONS[letter].items() if factor == truth[what]]


# 01's numbers
SAMPLES, BATCH_PER_GPU, GPUS = 128, 16, 8
EFFECTIVE_BATCH = 256
SHARDS = (10, 30)


def _shard_met(values):
    met = []
    if _close(sum(values), Fraction(1)):
        met.append("sum")
    if all(v > 0 for v in values) and all(_close(v * SHARDS[0], values[0] * size) for v, size in zip(values, SHARDS)):
        met.append("proportional")
    return met


def _two(first_key, first, second_key, second):
    """Two rubric lines of half a point each: the two parts of the reasoning a question asks for."""
    return (RubricLine(first_key, first, 0.5), RubricLine(second_key, second, 0.5))


def _naive_total(G):
    return _formula("naive", "total_sent")(G, 1)


def _master_total(G):
    return _formula("parameter_server", "total_sent")(G, 1)


_QUESTIONS = [
    Question(name="batch_size_quiz", notebook="01_why_data_parallelism", points=1, signature='"A", "B" or "C"',
             summary="the 4-GPU quiz: 128 samples, 16 per GPU per batch, the same number of epochs; which statement "
                     "is true?",
             answer_kind="choice", truth=_quiz_answer, explain=_quiz_explain, rubric=_quiz_lines(), met_by=_quiz_met),
    Question(name="batches_per_epoch", notebook="01_why_data_parallelism", points=1, signature="a number",
             summary="128 samples, 16 per GPU per batch, 8 GPUs: how many batches per epoch?",
             answer_kind="number", truth=lambda: math.ceil(SAMPLES / (BATCH_PER_GPU * GPUS)),
             quantity="each step uses 16 samples on each of the 8 GPUs",
             rubric=_two("steps", "an epoch is the 128 samples once, counted in whole steps",
                         "per_step", "one step takes 16 samples on each of the 8 GPUs: 128 samples"),
             slips=(Slip(lambda: math.ceil(SAMPLES / BATCH_PER_GPU), "That counts batches of one GPU's 16 samples; all 8 "
                         "GPUs take one batch each per step.", ("steps",)),
                    Slip(lambda: math.ceil(SAMPLES / (BATCH_PER_GPU // GPUS)), "16 is the batch of each GPU; one step's "
                         "batch is 16 times 8, not 16 divided by 8.", ("steps",)))),
    Question(name="batch_per_gpu", notebook="01_why_data_parallelism", points=1, signature="a number",
             summary="an effective batch of 256 on 8 GPUs: what batch size per GPU?",
             answer_kind="number", truth=lambda: EFFECTIVE_BATCH // GPUS,
             quantity="the effective batch is G times the batch per GPU",
             rubric=_two("split", "the effective batch is split over the GPUs (divided, not multiplied)",
                         "gpus", "over all 8 GPUs"),
             slips=(Slip(lambda: EFFECTIVE_BATCH * GPUS, "The effective batch is the sum of the GPUs' batches: each GPU "
                         "takes a share of it.", ("gpus",)),
                    Slip(lambda: EFFECTIVE_BATCH // QUIZ_GPUS, "There are 8 GPUs here, not the quiz's 4.", ("split",)))),
    Question(name="shard_weights", notebook="01_why_data_parallelism", points=1, signature="(w0, w1)",
             summary="two ranks hold shards of 10 and 30 samples: with what weights must their gradients be averaged?",
             answer_kind="numbers", truth=lambda: tuple(Fraction(n, sum(SHARDS)) for n in SHARDS),
             rubric=_two("sum", "the weights add up to 1",
                         "proportional", "each shard's weight is proportional to its sample count (10 : 30)"),
             met_by=_shard_met),
    Question(name="traffic_naive", notebook="03_naive_and_master_allreduce", points=1, signature="formula in G, N",
             summary="elements all G ranks send together in the naive exchange of N elements each",
             truth=_formula("naive", "total_sent"), quantity="elements sent by all ranks together",
             rubric=_two("per_rank", "one rank sends its tensor to each of the G - 1 others: (G - 1) N",
                         "all_ranks", "all G ranks together: G times one rank's"),
             slips=(Slip(lambda G, N: (G - 1) * N, "That is what one rank sends; the question asks for all G ranks "
                         "together.", ("per_rank",)),
                    Slip(lambda G, N: G * G * N, "A rank does not send to itself.", ("all_ranks",)),
                    Slip(lambda G, N: 2 * (G - 1) * N, "That is the parameter server's total."))),
    Question(name="traffic_naive_per_rank", notebook="03_naive_and_master_allreduce", points=1,
             signature="formula in G, N", summary="elements one rank sends in the naive exchange",
             truth=_formula("naive", "max_sent"), quantity="elements one rank sends",
             rubric=_two("one_rank", "counts what one rank sends, not all ranks together",
                         "others", "its whole tensor to each of the G - 1 others, not to itself"),
             slips=(Slip(lambda G, N: G * (G - 1) * N, "That is all ranks together; the question asks for one rank.",
                         ("others",)),
                    Slip(lambda G, N: G * N, "A rank does not send to itself.", ("one_rank",)))),
    Question(name="traffic_parameter_server", notebook="03_naive_and_master_allreduce", points=1,
             signature="formula in G, N", summary="elements all ranks send together in the parameter server all-reduce",
             truth=_formula("parameter_server", "total_sent"), quantity="elements sent by all ranks together",
             rubric=_two("to_root", "the G - 1 workers' tensors go to the root: (G - 1) N",
                         "back", "and the result comes back to each of them: twice that"),
             slips=(Slip(lambda G, N: (G - 1) * N, "That is one direction only: the tensors go to the root, and the "
                         "result comes back.", ("to_root",)),
                    Slip(lambda G, N: G * (G - 1) * N, "That is the naive exchange's total."),
                    Slip(lambda G, N: 2 * G * N, "The root does not send to itself.", ("back",)))),
    Question(name="traffic_parameter_server_root", notebook="03_naive_and_master_allreduce", points=1,
             signature="formula in G, N", summary="elements that leave the root (the master) in one all-reduce",
             truth=_formula("parameter_server", "max_sent"), quantity="elements the root sends",
             rubric=_two("leaves", "counts only what leaves the root, not what it receives",
                         "workers", "the result, N elements, to each of the G - 1 workers"),
             slips=(Slip(lambda G, N: 2 * (G - 1) * N, "That is what the root sends and receives together; the question "
                         "asks what leaves it.", ("workers",)),
                    Slip(lambda G, N: N, "That is what one worker sends.", ("leaves",)))),
    Question(name="naive_vs_master_ranks", notebook="03_naive_and_master_allreduce", points=1, signature="a number",
             summary="from how many ranks on does the naive exchange send at least ten times as many elements as the "
                     "master?",
             answer_kind="number",
             truth=lambda: next(g for g in range(2, 10_000) if _naive_total(g) >= 10 * _master_total(g)),
             quantity="compare G(G-1)N with 10 x 2(G-1)N",
             rubric=_two("compare", "compares the naive total G(G-1)N with ten times the master's total 2(G-1)N",
                         "smallest", "the smallest G at which it is at least ten times"),
             slips=(Slip(lambda: next(g for g in range(2, 10_000) if _naive_total(g) > 10 * _master_total(g)),
                         "One rank fewer already sends exactly ten times as much: 'at least' includes it.",
                         ("compare",)),
                    Slip(lambda: next(g for g in range(2, 10_000) if _naive_total(g) >= 10 * _master_total(g) / 2),
                         "The master's total is 2(G-1)N: the tensors go to the master and the result comes back.",
                         ("smallest",)))),
    Question(name="traffic_ring", notebook="06_ring_cost", points=1, signature="formula in G, N",
             summary="elements all ranks send together in the ring all-reduce",
             truth=_formula("ring", "total_sent"), quantity="elements sent by all ranks together",
             rubric=_two("per_rank", "each rank sends 2(G - 1) chunks of N/G: 2(G-1)N/G",
                         "all_ranks", "all G ranks together: G times that"),
             slips=(Slip(lambda G, N: 2 * (G - 1) * N / G, "That is one rank's share; all G ranks together send G "
                         "times that.", ("per_rank",)),
                    Slip(lambda G, N: (G - 1) * N, "That is one phase only; the ring has two.", ("all_ranks",)))),
    Question(name="traffic_ring_per_rank", notebook="06_ring_cost", points=1, signature="formula in G, N",
             summary="elements one rank sends in the ring all-reduce (N divisible by G)",
             truth=_formula("ring", "max_sent"), quantity="elements one rank sends",
             rubric=_two("phases", "both phases, scatter-reduce and all-gather",
                         "chunks", "G - 1 messages of one chunk, N/G elements, in each phase"),
             slips=(Slip(lambda G, N: 2 * (G - 1) * N, "That is all ranks together; the question asks for one rank.",
                         ("phases",)),
                    Slip(lambda G, N: (G - 1) * N / G, "That is one phase only: the ring has two, scatter-reduce and "
                                                      "all-gather.", ("chunks",)),
                    Slip(lambda G, N: 2 * N, "Close: that is what it approaches for large G. Count the chunks exactly.",
                         ("phases",)))),
    Question(name="ring_steps", notebook="06_ring_cost", points=1, signature="formula in G",
             summary="how many steps the ring all-reduce takes on G ranks",
             truth=lambda G, N: 2 * (G - 1), quantity="steps of both phases",
             rubric=_two("phases", "two phases, scatter-reduce and all-gather", "steps", "G - 1 steps in each phase"),
             slips=(Slip(lambda G, N: G - 1, "That is one phase only; the ring has two.", ("steps",)),
                    Slip(lambda G, N: 2 * G, "Each phase takes G - 1 steps, not G.", ("phases",)))),
]

for _question in _QUESTIONS:
    register(_question)
