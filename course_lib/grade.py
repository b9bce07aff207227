"""The grader moved out of course_lib: it is the package `course_grader`, installed apart (learners do not need it).

    pip install -e . -e ./course_grader          # from the repository's root
    python -m course_grader --help

Importing `course_lib.grade`, or running `python -m course_lib.grade`, says so and stops.
"""

MOVED = ("the grader is no longer part of course_lib: it is the package course_grader. Install it from the "
         "repository's root with `pip install -e ./course_grader` (or `pip install ./course_grader`), then run "
         "`python -m course_grader ...` or `import course_grader`")

if __name__ == "__main__":
    raise SystemExit(f"python -m course_lib.grade: {MOVED}")
raise ImportError(f"course_lib.grade: {MOVED}", name="course_lib.grade")
