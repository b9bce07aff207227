"""python -m course_grader: grade submitted notebooks in sandboxes, score them here.

    python -m course_grader SUBMISSION.ipynb [MORE.ipynb ...] [--json results.json]   one submission
    python -m course_grader --class submissions/ --out grades/                         a class: one folder per student
    python -m course_grader --nbgrader COURSE --assignment NAME --out grades/          nbgrader's submitted/ folders
    python -m course_grader --gradescope [--root /autograder]                          what run_autograder calls
    python -m course_grader --gradescope-autograder autograder.zip                     write Gradescope's zip
    python -m course_grader --rubric-defaults > rubric.toml                            every rubric line, its points

Common options: --rubric FILE (re-weight or drop rubric lines, TOML or JSON), --jobs N (notebooks at once;
default one per core), --timeout / --cell-timeout (seconds per notebook / per cell), --verbose.

What a submission is graded on: --assignment NAME (a number such as 04, or the notebook's name; several with
commas) grades every submission against that assignment's exercises, whatever its files are called; without it
each notebook is graded on its own assignment (its nbgrader metadata or its file name). An exercise found in
several notebooks is graded once; exercises of other assignments score nothing (see course_grader.assign).
With --nbgrader, --assignment names nbgrader's folder (and the course's assignment when it is one's name).

The sandbox: --isolation auto|namespaces|users|none (auto: the strongest this machine gives; see
course_grader.sandbox), and each notebook's limits --memory SIZE (4G), --disk SIZE (1G), --processes N (1024), --files N (50000).
A notebook that reaches one is stopped with a note saying which, and graded on what it did without that cell.
As root the sandboxes run as course_lib_grader, course_lib_grader1, ... (made when missing); the environment
variable COURSE_LIB_GRADE_USER names them otherwise.

A class writes OUT/<student>.json (Gradescope's results.json format, one test per rubric line) for every
student and OUT/grades.csv (one row per student, one column per exercise); with --nbgrader also
OUT/nbgrader_grades.csv, in the columns `nbgrader export` writes.

Exit status:
    0  every submission was read and graded (whatever it scored)
    2  bad arguments: a missing file, an unreadable rubric file, options that do not go together; or a machine
       the grader refuses to grade on (no isolation available, or one that would let a submission read your
       files: the message says what to do)
    3  some notebook could not be read or run (not a notebook, not Python, damaged; a student folder without
       a notebook); every other one was graded and all results were written
    4  the grader itself failed on some notebook (see its notes); the others were graded and written
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

__all__ = ["main", "EXIT_OK", "EXIT_USAGE", "EXIT_UNREADABLE", "EXIT_GRADER_FAILED"]

EXIT_OK, EXIT_USAGE, EXIT_UNREADABLE, EXIT_GRADER_FAILED = 0, 2, 3, 4


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m course_grader", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("notebooks", nargs="*", help="the notebooks of one submission")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--class", dest="class_dir", metavar="DIR", help="grade every student folder in DIR")
    mode.add_argument("--nbgrader", metavar="COURSE", help="grade COURSE/submitted/<student>/<assignment>/")
    mode.add_argument("--gradescope", action="store_true", help="grade ROOT/submission into ROOT/results/results.json")
    mode.add_argument("--gradescope-autograder", metavar="ZIP", help="write Gradescope's autograder zip")
    mode.add_argument("--rubric-defaults", action="store_true", help="print every rubric line and its default points")
    parser.add_argument("--assignment", help="the assignment every submission is for (04, 04_ring_scatter_reduce; "
                                             "several with commas); with --nbgrader: nbgrader's folder name")
    parser.add_argument("--root", default="/autograder", help="with --gradescope: Gradescope's folder (/autograder)")
    parser.add_argument("--out", metavar="DIR", help="with --class / --nbgrader: where to write results (grades/)")
    parser.add_argument("--json", metavar="PATH", help="one submission: write Gradescope's results.json here")
    parser.add_argument("--rubric", metavar="FILE", help="re-weight or drop rubric lines (TOML or JSON)")
    parser.add_argument("--jobs", type=int, help="notebooks graded at once (default: one per core)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for one notebook (900)")
    parser.add_argument("--cell-timeout", type=float, default=300.0, help="seconds for one cell (300)")
    parser.add_argument("--verbose", action="store_true", help="print every exercise's full feedback")
    parser.add_argument("--isolation", default="auto", choices=("auto", "namespaces", "users", "none"),
                        help="how submissions are kept apart (auto: the strongest available)")
    parser.add_argument("--memory", default="4G", help="memory of one notebook's sandbox, all its processes (4G)")
    parser.add_argument("--disk", default="1G", help="what one notebook's sandbox may write (1G)")
    parser.add_argument("--processes", type=int, default=1024,
                        help="processes and threads in one notebook's sandbox (1024)")
    parser.add_argument("--files", type=int, default=50_000,
                        help="files and folders one notebook's sandbox may make, empty ones included (50000)")
    return parser


def _exit_status(submission_grades) -> int:
    statuses = {s.status for s in submission_grades}
    if "failed" in statuses:
        return EXIT_GRADER_FAILED
    if statuses - {"graded", "skipped"}:
        return EXIT_UNREADABLE
    return EXIT_OK


def _say_who_runs_the_code(isolation, limits, stream) -> None:
    from course_grader.sandbox import describe_isolation

    print(f"{describe_isolation(isolation)}; limits per notebook: {limits.describe()}", file=stream)


def _nbgrader_csv(path, assignment, submission_grades) -> None:
    import csv
    import io

    from course_lib.exercises.report import format_points
    from course_grader.results import write_atomically

    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["assignment", "duedate", "timestamp", "student_id", "last_name", "first_name", "email",
                     "raw_score", "late_submission_penalty", "score", "max_score"])
    from course_grader.results import csv_cell

    for submission in submission_grades:
        score = format_points(submission.score)
        writer.writerow([csv_cell(cell) for cell in (assignment, "", "", submission.name, "", "", "", score, "0", score,
                                                     format_points(submission.max_score))])
    write_atomically(path, buffer.getvalue())


def _file_name(name: str) -> str:
    """A student's name as a file name in OUT: no folder separators, no leading dot, at most 200 characters."""
    safe = "".join(c if c.isprintable() and c not in "/\\\0" else "_" for c in name).lstrip(".") or "_"
    return safe[:200]


def _file_names(names) -> dict:
    """{name: its results file's name, without .json}: distinct for distinct names. Where two names would make
    the same file (a name with a character a file name cannot hold, one cut at 200 characters, two that differ
    only in case, which a case-insensitive disk such as macOS's merges), each of them that was changed (or all,
    for names that differ only in case) gets the first 8 hex digits of its SHA-256 appended."""
    import hashlib

    from course_grader.notebook import safe_name

    def tagged(name):
        return f"{_file_name(name)[:190]}-{hashlib.sha256(name.encode('utf-8', 'surrogatepass')).hexdigest()[:8]}"

    plain = {name: _file_name(name) for name in names}
    groups: dict = {}
    for name, file in plain.items():
        groups.setdefault(file.casefold(), []).append(name)
    files = {}
    for group in groups.values():
        if len(group) == 1:
            files[group[0]] = plain[group[0]]
            continue
        unchanged = [n for n in group if plain[n] == n]
        for name in group:
            files[name] = plain[name] if unchanged == [name] else tagged(name)
    seen: dict = {}
    for name, file in files.items():          # a name chosen to equal another's tagged file: refuse, naming both
        other = seen.setdefault(file.casefold(), name)
        if other != name:
            raise ValueError(f"the students {safe_name(other)!r} and {safe_name(name)!r} would both be written to "
                             f"{safe_name(file)}.json: rename one of their folders and grade again")
    return files


def _write_class(out: pathlib.Path, submission_grades, seconds) -> None:
    from course_grader.results import dump_json, submission_json, write_csv

    out.mkdir(parents=True, exist_ok=True)
    files = _file_names([s.name for s in submission_grades])
    for submission in submission_grades:
        results = submission_json(submission)
        results.update(submission=submission.name, status=submission.status, assignments=submission.assignments)
        if submission.problem:
            results["output"] = submission.problem
        dump_json(out / f"{files[submission.name]}.json", results)
    write_csv(out / "grades.csv", submission_grades)


def _gradescope(args, weights, options) -> int:
    from course_grader import batch, gradescope, results

    root = pathlib.Path(args.root)
    gradescope.prepare_root(root)
    _say_who_runs_the_code(options["isolation"], options["limits"], sys.stdout)
    submission = batch.collect_files([root / "submission"], name="submission")
    started = time.monotonic()
    if submission.problem and not options["assignment"]:
        results.dump_json(root / "results" / "results.json",
                          {"score": 0, "output": "No notebook (.ipynb) was found in your submission: upload the "
                                                 "notebooks themselves.", "tests": []})
        return EXIT_UNREADABLE
    (grade,) = batch.grade_submissions([submission], jobs=args.jobs, weights=weights, timeout=args.timeout,
                                       cell_timeout=args.cell_timeout, progress=sys.stdout,
                                       protect=[root / "source", root / "results"], **options)
    results.dump_json(root / "results" / "results.json",
                      results.submission_json(grade, seconds=time.monotonic() - started))
    print(results.table(grade.notebooks, args.verbose, notes=grade.notes))
    return _exit_status([grade])


def _hide_arguments(argv) -> None:
    """Without namespaces every user can read this process's command line in /proc: start again with the
    arguments (the submissions' folder, where results go) in the environment instead, which only root and this
    user can read."""
    os.execve(sys.executable, [sys.executable, "-m", "course_grader"],
              {**os.environ, "COURSE_LIB_GRADE_ARGV": json.dumps(list(argv))})


def _options(args, parser) -> dict:
    """isolation, limits and assignment from the arguments (the usage error when one is wrong)."""
    from course_grader import assign
    from course_grader.sandbox import IsolationError, Limits, choose_isolation, parse_size

    try:
        limits = Limits(memory=parse_size(args.memory), disk=parse_size(args.disk), processes=args.processes,
                        files=args.files)
    except ValueError as exc:
        parser.error(str(exc))
    if limits.processes < 16:
        parser.error("--processes must be 16 or more (a launch of 8 ranks needs dozens of threads)")
    if limits.files < 1000:
        parser.error("--files must be 1000 or more (Python, torch and a launch of 8 ranks make hundreds)")
    if limits.memory < 256 << 20:
        parser.error("--memory must be 256M or more (a sandbox's Python with torch needs about 300 MB)")
    assignment = None
    if args.assignment:
        try:
            assignment = assign.resolve_assignment(args.assignment)
        except ValueError as exc:
            if not args.nbgrader:
                parser.error(str(exc))
    try:
        isolation = choose_isolation(args.isolation)
    except IsolationError as exc:
        parser.error(str(exc))
    return {"isolation": isolation, "limits": limits, "assignment": assignment}


def _stop_cleanly(signum, frame):
    """SIGTERM or SIGHUP (a `kill`, a closed terminal, a CI job cancelled): end as Ctrl-C does, so every sandbox is
    stopped and every work folder removed on the way out."""
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        for number in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(number, _stop_cleanly)
    if argv is None and "COURSE_LIB_GRADE_ARGV" in os.environ:
        argv = json.loads(os.environ.pop("COURSE_LIB_GRADE_ARGV"))
    parser = _parser()
    args = parser.parse_args(argv)
    from course_lib.exercises.rubric_file import RubricFileError, defaults_toml, load_weights

    if args.rubric_defaults:
        print(defaults_toml(), end="")
        return EXIT_OK
    try:
        weights = load_weights(args.rubric) if args.rubric else None
    except RubricFileError as exc:
        parser.error(str(exc))
    if args.gradescope_autograder:
        from course_grader.gradescope import build_autograder

        if args.assignment:
            from course_grader import assign

            try:
                assign.resolve_assignment(args.assignment)
            except ValueError as exc:
                parser.error(str(exc))
        names = build_autograder(args.gradescope_autograder, rubric=args.rubric, assignment=args.assignment)
        print(f"wrote {args.gradescope_autograder} ({len(names)} files): upload it as the assignment's autograder")
        return EXIT_OK
    if args.jobs is not None and args.jobs < 1:
        parser.error("--jobs must be 1 or more")
    options = _options(args, parser)
    if options["isolation"] == "users" and argv is None and len(sys.argv) > 1:
        _hide_arguments(sys.argv[1:])
    from course_grader.sandbox import IsolationError

    if args.gradescope:
        try:
            return _gradescope(args, weights, options)
        except IsolationError as exc:
            parser.error(str(exc))

    from course_grader import batch, results

    if args.nbgrader:
        if not args.assignment:
            parser.error("--nbgrader needs --assignment NAME (the folder under submitted/<student>/)")
        if not (pathlib.Path(args.nbgrader) / "submitted").is_dir():
            parser.error(f"no submitted/ folder in {args.nbgrader}: give the nbgrader course's folder")
        submissions = batch.collect_nbgrader(args.nbgrader, args.assignment)
    elif args.class_dir:
        if not pathlib.Path(args.class_dir).is_dir():
            parser.error(f"no such folder: {args.class_dir}")
        submissions = batch.collect_class(args.class_dir)
    else:
        if not args.notebooks:
            parser.error("give the notebooks to grade, or --class DIR, --nbgrader COURSE, --gradescope")
        missing = [p for p in args.notebooks if not pathlib.Path(p).exists()]
        if missing:
            parser.error(f"no such file: {', '.join(missing)}")
        submissions = [batch.collect_files(args.notebooks)]
    if (args.nbgrader or args.class_dir) and args.json:
        parser.error("--json is for one submission; a class writes one file per student with --out DIR")
    if not submissions:
        parser.error("nothing to grade: no student folder found")

    _say_who_runs_the_code(options["isolation"], options["limits"], sys.stderr)
    several = len(submissions) > 1 or bool(args.class_dir or args.nbgrader)
    if several:
        try:
            _file_names([s.name for s in submissions])      # two students, one results file: refused before grading
        except ValueError as exc:
            parser.error(str(exc))
    started = time.monotonic()
    try:
        grades = batch.grade_submissions(submissions, jobs=args.jobs, weights=weights, timeout=args.timeout,
                                         cell_timeout=args.cell_timeout, progress=sys.stderr, **options)
    except IsolationError as exc:
        parser.error(str(exc))
    seconds = time.monotonic() - started
    if several:
        out = pathlib.Path(args.out or "grades")
        _write_class(out, grades, seconds)
        if args.nbgrader:
            _nbgrader_csv(out / "nbgrader_grades.csv", args.assignment, grades)
        from course_grader.notebook import safe_name

        for grade in grades:
            print(f"{safe_name(grade.name)}: {grade.score:g}/{grade.max_score:g}" + ("" if grade.status == "graded"
                                                                                   else f" ({grade.status})"))
        print(f"wrote {out}/<student>.json for {len(grades)} students and {out}/grades.csv in {seconds:.0f} s")
    else:
        (grade,) = grades
        if grade.problem:
            print(grade.problem, file=sys.stderr)
        print(results.table(grade.notebooks, args.verbose, notes=grade.notes))
        if args.json:
            results.dump_json(args.json, results.submission_json(grade, seconds=seconds))
    return _exit_status(grades)
