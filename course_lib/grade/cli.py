"""python -m course_lib.grade: grade submitted notebooks in sandboxes, score them here.

    python -m course_lib.grade SUBMISSION.ipynb [MORE.ipynb ...] [--json results.json]   one submission
    python -m course_lib.grade --class submissions/ --out grades/                         a class: one folder per student
    python -m course_lib.grade --nbgrader COURSE --assignment NAME --out grades/          nbgrader's submitted/ folders
    python -m course_lib.grade --gradescope [--root /autograder]                          what run_autograder calls
    python -m course_lib.grade --gradescope-autograder autograder.zip                     write Gradescope's zip
    python -m course_lib.grade --rubric-defaults > rubric.toml                            every rubric line, its points

Common options: --rubric FILE (re-weight or drop rubric lines, TOML or JSON), --jobs N (notebooks at once;
default one per core), --timeout / --cell-timeout (seconds per notebook / per cell), --verbose.

A class writes OUT/<student>.json (Gradescope's results.json format, one test per rubric line) for every
student and OUT/grades.csv (one row per student, one column per exercise); with --nbgrader also
OUT/nbgrader_grades.csv, in the columns `nbgrader export` writes.

Exit status:
    0  every submission was read and graded (whatever it scored)
    2  bad arguments: a missing file, an unreadable rubric file, options that do not go together
    3  some notebook could not be read or run (not a notebook, not Python, damaged; a student folder without
       a notebook); every other one was graded and all results were written
    4  the grader itself failed on some notebook (see its notes); the others were graded and written
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

__all__ = ["main", "EXIT_OK", "EXIT_USAGE", "EXIT_UNREADABLE", "EXIT_GRADER_FAILED"]

EXIT_OK, EXIT_USAGE, EXIT_UNREADABLE, EXIT_GRADER_FAILED = 0, 2, 3, 4


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m course_lib.grade", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("notebooks", nargs="*", help="the notebooks of one submission")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--class", dest="class_dir", metavar="DIR", help="grade every student folder in DIR")
    mode.add_argument("--nbgrader", metavar="COURSE", help="grade COURSE/submitted/<student>/<assignment>/")
    mode.add_argument("--gradescope", action="store_true", help="grade ROOT/submission into ROOT/results/results.json")
    mode.add_argument("--gradescope-autograder", metavar="ZIP", help="write Gradescope's autograder zip")
    mode.add_argument("--rubric-defaults", action="store_true", help="print every rubric line and its default points")
    parser.add_argument("--assignment", help="with --nbgrader: the assignment's name")
    parser.add_argument("--root", default="/autograder", help="with --gradescope: Gradescope's folder (/autograder)")
    parser.add_argument("--out", metavar="DIR", help="with --class / --nbgrader: where to write results (grades/)")
    parser.add_argument("--json", metavar="PATH", help="one submission: write Gradescope's results.json here")
    parser.add_argument("--rubric", metavar="FILE", help="re-weight or drop rubric lines (TOML or JSON)")
    parser.add_argument("--jobs", type=int, help="notebooks graded at once (default: one per core)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for one notebook (900)")
    parser.add_argument("--cell-timeout", type=float, default=300.0, help="seconds for one cell (300)")
    parser.add_argument("--verbose", action="store_true", help="print every exercise's full feedback")
    return parser


def _exit_status(submission_grades) -> int:
    statuses = {s.status for s in submission_grades}
    if "failed" in statuses:
        return EXIT_GRADER_FAILED
    if statuses - {"graded"}:
        return EXIT_UNREADABLE
    return EXIT_OK


def _say_who_runs_the_code(stream) -> None:
    from course_lib.grade.sandbox import DEFAULT_USER, running_as_root

    if running_as_root():
        print(f"grading as root: the submissions run as the unprivileged user {DEFAULT_USER} (and {DEFAULT_USER}1, "
              "... for students graded at the same time)", file=stream)
    else:
        print("grading without root: the submissions run as your own user. They cannot change their grades, but "
              "can read and write what you can; grade as root in a container to keep them out of your files.",
              file=stream)


def _nbgrader_csv(path, assignment, submission_grades) -> None:
    import csv
    import io

    from course_lib.exercises.report import format_points
    from course_lib.grade.results import write_atomically

    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["assignment", "duedate", "timestamp", "student_id", "last_name", "first_name", "email",
                     "raw_score", "late_submission_penalty", "score", "max_score"])
    for submission in submission_grades:
        score = format_points(submission.score)
        writer.writerow([assignment, "", "", submission.name, "", "", "", score, "0", score,
                         format_points(submission.max_score)])
    write_atomically(path, buffer.getvalue())


def _write_class(out: pathlib.Path, submission_grades, seconds) -> None:
    from course_lib.grade.results import dump_json, results_json, write_csv

    out.mkdir(parents=True, exist_ok=True)
    for submission in submission_grades:
        results = results_json(submission.notebooks)
        results.update(submission=submission.name, status=submission.status)
        if submission.problem:
            results["output"] = submission.problem
        dump_json(out / f"{submission.name}.json", results)
    write_csv(out / "grades.csv", submission_grades)


def _gradescope(args, weights) -> int:
    from course_lib.grade import batch, gradescope, results

    root = pathlib.Path(args.root)
    gradescope.prepare_root(root)
    submission = batch.collect_files([root / "submission"], name="submission")
    started = time.monotonic()
    if submission.problem:
        results.dump_json(root / "results" / "results.json",
                          {"score": 0, "output": "No notebook (.ipynb) was found in your submission: upload the "
                                                 "notebooks themselves.", "tests": []})
        return EXIT_UNREADABLE
    (grade,) = batch.grade_submissions([submission], jobs=args.jobs, weights=weights, timeout=args.timeout,
                                       cell_timeout=args.cell_timeout, progress=sys.stdout)
    results.dump_json(root / "results" / "results.json",
                      results.results_json(grade.notebooks, seconds=time.monotonic() - started))
    print(results.table(grade.notebooks, args.verbose))
    return _exit_status([grade])


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    from course_lib.exercises.rubric import RubricFileError, defaults_toml, load_weights

    if args.rubric_defaults:
        print(defaults_toml(), end="")
        return EXIT_OK
    try:
        weights = load_weights(args.rubric) if args.rubric else None
    except RubricFileError as exc:
        parser.error(str(exc))
    if args.gradescope_autograder:
        from course_lib.grade.gradescope import build_autograder

        names = build_autograder(args.gradescope_autograder, rubric=args.rubric)
        print(f"wrote {args.gradescope_autograder} ({len(names)} files): upload it as the assignment's autograder")
        return EXIT_OK
    if args.jobs is not None and args.jobs < 1:
        parser.error("--jobs must be 1 or more")
    if args.gradescope:
        return _gradescope(args, weights)

    from course_lib.grade import batch, results

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

    _say_who_runs_the_code(sys.stderr)
    from course_lib.grade.sandbox import running_as_root

    if running_as_root():
        batch.warn_about_exposure(submissions, sys.stderr)
    several = len(submissions) > 1 or bool(args.class_dir or args.nbgrader)
    started = time.monotonic()
    grades = batch.grade_submissions(submissions, jobs=args.jobs, weights=weights, timeout=args.timeout,
                                     cell_timeout=args.cell_timeout, progress=sys.stderr)
    seconds = time.monotonic() - started
    if several:
        out = pathlib.Path(args.out or "grades")
        _write_class(out, grades, seconds)
        if args.nbgrader:
            _nbgrader_csv(out / "nbgrader_grades.csv", args.assignment, grades)
        for grade in grades:
            print(f"{grade.name}: {grade.score:g}/{grade.max_score:g}" + ("" if grade.status == "graded"
                                                                        else f" ({grade.status})"))
        print(f"wrote {out}/<student>.json for {len(grades)} students and {out}/grades.csv in {seconds:.0f} s")
    else:
        (grade,) = grades
        if grade.problem:
            print(grade.problem, file=sys.stderr)
        print(results.table(grade.notebooks, args.verbose))
        if args.json:
            results.dump_json(args.json, results.results_json(grade.notebooks, seconds=seconds))
    return _exit_status(grades)
