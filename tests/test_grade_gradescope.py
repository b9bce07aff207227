"""The Gradescope autograder zip, run in a temporary folder laid out like Gradescope's /autograder, as root,
with the submission running as the unprivileged sandbox user.

setup.sh needs the network (it installs torch and the pinned packages into /opt/course_lib), so it is checked
for what it installs rather than run; run_autograder is run for real, with AUTOGRADER_ROOT pointing at the
temporary folder and COURSE_LIB_PYTHON at this interpreter (whose packages are the ones setup.sh pins), and
course_lib imported from the zip's own copy (in source/, root's alone, as setup.sh installs it).

Gradescope's container gives no namespaces: the run is made with isolation 'users' forced (the fallback: a user
of its own, the course_lib mirror, a sweep after), and once more with namespaces, as on a machine of your own.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import shutil
import stat
import subprocess
import sys
import zipfile

import nbformat
import pytest

from course_lib.exercises import registry
from course_grader import gradescope
from test_grade_isolation import clean_machine

ROOT = pathlib.Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="Gradescope runs the autograder as root; so does this test")

# A cell of the submitted notebook 06 that tries what a submission on Gradescope might: read the autograder's
# files and the submission as uploaded, write the results, and leave a process running. It raises an error
# that reports what it managed, which the grader notes.
PROBE = '''
import os, pathlib, subprocess
traffic_ring = "2*(G-1)*N"
traffic_ring_per_rank = "2(G-1)N/G"
ring_steps = "2(G-1)"
root = pathlib.Path(os.environ.get("COURSE_LIB_SANDBOX_AUTOGRADER_ROOT", "/autograder"))
report = []
for what, attempt in (("read source", lambda: (root / "source" / "rubric.toml").read_text()),
                      ("list source", lambda: os.listdir(root / "source")),
                      ("read upload", lambda: (root / "submission" / "04_ring_scatter_reduce.ipynb").read_bytes()),
                      ("write results", lambda: (root / "results" / "results.json").write_text('{"score": 1000}'))):
    try:
        found = attempt()
        report.append(f"{what}: {found if what.startswith('list') else 'done'}")
    except OSError as exc:
        report.append(f"{what}: {type(exc).__name__}")
subprocess.Popen(["sleep", "6004"], start_new_session=True)
raise RuntimeError("PROBE " + "; ".join(report))
'''


def _running(command: bytes) -> list[int]:
    """Processes whose command line is `command` (NUL-separated, as /proc shows it)."""
    found = []
    for path in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if path.read_bytes().rstrip(b"\0") == command:
                found.append(int(path.parent.name))
        except OSError:
            continue
    return found


def test_the_zip_pins_what_setup_installs(tmp_path):
    names = gradescope.build_autograder(tmp_path / "autograder.zip")
    assert {"setup.sh", "run_autograder", "requirements.txt", "course_lib_src/pyproject.toml",
            "course_lib_src/course_grader/judge.py"} <= set(names)
    assert not any("__pycache__" in name for name in names)
    with zipfile.ZipFile(tmp_path / "autograder.zip") as archive:
        setup = archive.read("setup.sh").decode()
        requirements = archive.read("requirements.txt").decode().split()
        modes = {info.filename: info.external_attr >> 16 for info in archive.infolist()}
    torch_version = importlib.metadata.version("torch").split("+")[0]
    assert f'"torch=={torch_version}"' in setup and gradescope.CPU_INDEX in setup     # the small CPU build
    assert "useradd" in setup and "course_lib_src" in setup
    assert requirements == [f"{name}=={importlib.metadata.version(name)}" for name in gradescope.PINNED]
    assert modes["run_autograder"] & stat.S_IXUSR and modes["setup.sh"] & stat.S_IXUSR


@pytest.fixture
def open_folder():
    """A folder every user may enter, as Gradescope's /autograder (pytest's own tmp_path is root's alone)."""
    import tempfile

    folder = pathlib.Path(tempfile.mkdtemp(prefix="course_lib-gradescope-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("isolation", ["users", "namespaces"])
def test_run_autograder_grades_the_submission_in_gradescopes_layout(isolation, tmp_path, open_folder):
    rubric = tmp_path / "rubric.toml"
    rubric.write_text("[ring_scatter_reduce]\nreturned = 1\nsingle = 0\n")
    zip_path = tmp_path / "autograder.zip"
    done = subprocess.run([sys.executable, "-m", "course_grader", "--gradescope-autograder", str(zip_path),
                           "--rubric", str(rubric)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    root = open_folder / "autograder"
    with zipfile.ZipFile(zip_path) as archive:
        archive.extractall(root / "source")
    (root / "source" / "run_autograder").chmod(0o755)
    submission = root / "submission"
    submission.mkdir()
    shutil.copy(ROOT / "notebooks" / "04_ring_scatter_reduce.ipynb", submission)
    submission.chmod(0o755)
    (submission / "04_ring_scatter_reduce.ipynb").chmod(0o644)         # as uploaded: readable by everyone
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook.cells = [nbformat.v4.new_code_cell(PROBE)]
    nbformat.write(notebook, submission / "06_ring_cost.ipynb")
    (submission / "notes.md").write_text("not a notebook, and not graded\n")
    environment = dict(os.environ, AUTOGRADER_ROOT=str(root), COURSE_LIB_PYTHON=sys.executable,
                       COURSE_LIB_SANDBOX_AUTOGRADER_ROOT=str(root), COURSE_LIB_GRADE_ISOLATION=isolation,
                       PYTHONPATH=str(root / "source" / "course_lib_src"))
    command = ["bash", str(root / "source" / "run_autograder")]
    if isolation == "users":     # Gradescope's machine: no solved notebook readable by all but the submission's own
        command = clean_machine(command, leave=[submission / "04_ring_scatter_reduce.ipynb"])
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=environment, cwd=root)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads((root / "results" / "results.json").read_text())
    assert results["score"] != 1000, "the submission wrote the results"
    lines = {line.key: line.points for line in registry.get("ring_scatter_reduce").rubric}
    weighted = {**lines, "returned": 1, "single": 0}
    assert results["score"] == sum(weighted.values()) + 3, results   # 04 with the rubric file, and 06's answers
    assert {t["name"] for t in results["tests"] if t["name"].startswith("04_")} == \
        {f"04_ring_scatter_reduce: ring_scatter_reduce: {key}" for key, points in weighted.items() if points}
    assert all(t["status"] == "passed" for t in results["tests"])
    probe = next(t["output"] for t in results["tests"] if t["name"] == "06_ring_cost: notebook run")
    probe = probe.split("PROBE ", 1)[1].splitlines()[0]                # the submission ran, and could do none of it
    outcomes = dict(part.split(": ") for part in probe.split("; "))
    assert set(outcomes) == {"read source", "list source", "read upload", "write results"}, probe
    if isolation == "users":
        assert set(outcomes.values()) == {"PermissionError"}, probe
    else:       # not even there; the folder holds nothing but the way to the course_lib it runs
        assert outcomes.pop("list source") == "['course_lib_src']", probe
        assert set(outcomes.values()) == {"FileNotFoundError"}, probe
    for folder in ("source", "submission", "results"):
        assert stat.S_IMODE((root / folder).stat().st_mode) == 0o700
    assert _running(b"sleep\x006004") == []                          # the sleep it started is gone
    assert ("grading with namespaces" if isolation == "namespaces" else "grading without namespaces") in done.stdout
