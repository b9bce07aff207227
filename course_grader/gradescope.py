"""Gradescope: the autograder zip an instructor uploads, and what its run_autograder does.

    python -m course_grader --gradescope-autograder autograder.zip [--rubric rubric.toml] [--assignment 04]

writes a zip with (https://gradescope-autograders.readthedocs.io/en/latest/specs/):

    setup.sh          run once as root when Gradescope builds the image: a virtual environment in /opt/course_lib
                      with the CPU build of torch and the other packages at the versions installed where the zip
                      was made, course_lib and course_grader from the zip, and the unprivileged user the submissions run as
    run_autograder    run as root for every submission: grades /autograder/submission/**/*.ipynb into
                      /autograder/results/results.json (`python -m course_grader --gradescope`)
    requirements.txt  the pinned packages; course_lib_src/ course_lib and course_grader; rubric.toml / .json if given;
                      assignment.txt: the assignment every submission is graded against, if given

At grading time the judge first makes /autograder/source, /autograder/submission and /autograder/results
readable by root only: the submission runs on its own copy of the notebook, unable to read the autograder or
write the results. Gradescope's container gives no namespaces, so grading there uses isolation 'users' (see
course_grader.sandbox); one container grades one submission.
AUTOGRADER_ROOT and COURSE_LIB_PYTHON, when set, replace /autograder and /opt/course_lib/bin/python: the tests
run the same script in a temporary folder laid out like Gradescope's.
"""

from __future__ import annotations

import importlib.metadata
import io
import pathlib
import zipfile

from course_grader.sandbox import DEFAULT_USER

__all__ = ["build_autograder", "prepare_root", "PINNED"]

# What the sandbox needs at run time, pinned to the versions installed where the zip is built.
PINNED = ("numpy", "cloudpickle", "matplotlib", "ipywidgets", "ipykernel", "ipython")
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
VENV = "/opt/course_lib"

SETUP_SH = f"""#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image.
set -euxo pipefail
cd "$(dirname "$0")"
if ! command -v python3 >/dev/null || ! python3 -c "import venv" 2>/dev/null; then
    apt-get update -y && apt-get install -y --no-install-recommends python3 python3-venv python3-pip
fi
python3 -m venv {VENV}
{VENV}/bin/pip install --upgrade pip
{VENV}/bin/pip install --index-url {CPU_INDEX} "torch=={{torch}}"
{VENV}/bin/pip install -r requirements.txt
{VENV}/bin/pip install ./course_lib_src
chmod -R a+rX {VENV}
id {DEFAULT_USER} >/dev/null 2>&1 || useradd --system --no-create-home --home-dir /nonexistent \\
    --shell /usr/sbin/nologin --user-group {DEFAULT_USER}
"""

RUN_AUTOGRADER = f"""#!/usr/bin/env bash
# Gradescope runs this as root for every submission: /autograder/submission in, /autograder/results/results.json out.
set -u
ROOT="${{AUTOGRADER_ROOT:-/autograder}}"
PYTHON="${{COURSE_LIB_PYTHON:-{VENV}/bin/python}}"
RUBRIC=()
for candidate in "$ROOT/source/rubric.toml" "$ROOT/source/rubric.json"; do
    [ -f "$candidate" ] && RUBRIC=(--rubric "$candidate")
done
ASSIGNMENT=()
[ -f "$ROOT/source/assignment.txt" ] && ASSIGNMENT=(--assignment "$(cat "$ROOT/source/assignment.txt")")
"$PYTHON" -m course_grader --gradescope --root "$ROOT" "${{RUBRIC[@]}}" "${{ASSIGNMENT[@]}}"
status=$?
if [ ! -s "$ROOT/results/results.json" ]; then
    mkdir -p "$ROOT/results"
    printf '{{"score": 0, "output": "The autograder stopped (exit status %s) before it could grade this submission: please tell your instructor."}}\\n' "$status" > "$ROOT/results/results.json"
fi
# results.json says how the submission did (exit status 3 means a notebook could not be read or run, and
# results.json says which); Gradescope reads that file, so the script itself succeeds.
exit 0
"""


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(f"{package} is not installed here: install the course's requirements "
                           "(pip install -r requirements/base.txt) before building the autograder") from None


def _source_files(package_root: pathlib.Path):
    """A package's files for `pip install` (no caches, not its own pyproject): course_lib's, and this grader's."""
    for path in sorted(package_root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc" and \
                path.relative_to(package_root) != pathlib.Path("pyproject.toml"):
            yield path, pathlib.Path("course_lib_src") / package_root.name / path.relative_to(package_root)


def _pyproject(version: str) -> str:
    return (f'[build-system]\nrequires = ["setuptools>=64"]\nbuild-backend = "setuptools.build_meta"\n\n'
            f'[project]\nname = "course_lib"\nversion = "{version}"\nrequires-python = ">=3.10"\n'
            f'dependencies = ["torch>=2.2", "cloudpickle>=2.0", "numpy>=1.22", "ipython>=8"]\n\n'
            f'[tool.setuptools.packages.find]\ninclude = ["course_lib*", "course_grader*"]\n')


def build_autograder(zip_path, rubric=None, assignment: str | None = None) -> list[str]:
    """Write Gradescope's autograder zip to `zip_path`; returns the names of its files.

    Args:
        rubric: a rubric file (TOML or JSON, `rubric_file.load_weights` checks it first) to grade with.
        assignment: the assignment every submission is graded against (`assign.resolve_assignment` checks it).

    Example::

        >>> build_autograder("autograder.zip", rubric="rubric.toml")
        ['setup.sh', 'run_autograder', 'requirements.txt', 'rubric.toml', 'course_lib_src/pyproject.toml', ...]
    """
    import course_lib
    from course_lib.exercises.rubric_file import load_weights

    if rubric is not None:
        load_weights(rubric)          # a broken file fails here, not on every submission
    versions = {name: _version(name) for name in ("torch", *PINNED)}
    torch_version = versions.pop("torch").split("+")[0]
    files = {"setup.sh": SETUP_SH.format(torch=torch_version), "run_autograder": RUN_AUTOGRADER,
             "requirements.txt": "".join(f"{name}=={version}\n" for name, version in versions.items())}
    if assignment:
        from course_grader.assign import resolve_assignment

        files["assignment.txt"] = ",".join(resolve_assignment(assignment)) + "\n"
    if rubric is not None:
        suffix = pathlib.Path(rubric).suffix.lower()
        files["rubric.json" if suffix == ".json" else "rubric.toml"] = pathlib.Path(rubric).read_text()
    files["course_lib_src/pyproject.toml"] = _pyproject(getattr(course_lib, "__version__", "0"))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, text in files.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (0o755 if name in ("setup.sh", "run_autograder") else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, text)
        for package in (pathlib.Path(course_lib.__file__).parent, pathlib.Path(__file__).resolve().parent):
            for path, name in _source_files(package):
                archive.write(path, str(name))
    pathlib.Path(zip_path).write_bytes(buffer.getvalue())
    with zipfile.ZipFile(zip_path) as archive:
        return archive.namelist()


def prepare_root(root) -> None:
    """Before any submission code runs: the autograder's files, the submission as uploaded and the results folder
    become root's alone (the sandbox gets its own copy of each notebook)."""
    root = pathlib.Path(root)
    (root / "results").mkdir(parents=True, exist_ok=True)
    for folder in (root / "source", root / "submission", root / "results"):
        if folder.exists() and not folder.is_symlink():
            folder.chmod(0o700)
