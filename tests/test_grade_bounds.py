"""A class always finishes: what one submission holds can fail only that submission, in both isolation modes.

One `python -m course_grader --class` run per setup grades, beside an honest student, the submissions that
broke the judge before (the grading issue's review): JSON nested 100,000 deep, an answer of 100,000 terms,
eleven cells of 499 shell lines each (IPython rewrites one per pass: minutes of the judge's time before any
sandbox started), a cell error full of terminal escape codes that forges the printed table, a reply frame of
30 MB of empty objects (1.8 GB in the judge), and two student folders whose names map to one results file.
Each test checks its student's score and reason; the run must end with every student graded and written, the
magics notebook graded or refused within 60 s, and the judge's own memory (its peak resident set, read from
/proc while it runs) under 1 GB.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from course_grader import cli, reading
from test_grade_isolation import ANSWERS_06, _namespaces_or_fail, _write, clean_machine

ROOT = pathlib.Path(__file__).resolve().parent.parent
USER = "course_lib_bounds"
NB06 = "06_ring_cost.ipynb"
TWO_ANSWERS = 'traffic_ring_per_rank = "2(G-1)N/G"\nring_steps = "2(G-1)"'
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandboxes run as other users, which needs root")

FORGED = "ring_scatter_reduce  10/10  passed\ntotal  10/10"
ESCAPES = ('raise RuntimeError("\\x1b[2K\\x1b[1A\\r\\x1b[32m' + FORGED.replace("\n", "\\n") +
           '\\x1b[0m\\u202e\\x9b2J")')
BIG_REPLY = '''
import os, struct, sys
from course_grader import channel
frame = b"[" + b"{}," * 10_000_000 + b"{}]"            # 30 MB of empty objects
def send(fd, value):
    data = struct.pack(">I", len(frame)) + frame
    while data:
        data = data[os.write(fd, data):]
channel.send = send
traffic_ring = traffic_ring
'''


def _class(klass: pathlib.Path) -> dict:
    """The class; returns {student: (score, max_score)}, what each one's honest part earns."""
    _write(klass / "honest" / NB06, [ANSWERS_06])
    (klass / "deep_json").mkdir(parents=True)
    (klass / "deep_json" / NB06).write_text('{"cells": [' + "[" * 100_000 + "]" * 100_000 + "]}")
    _write(klass / "deep_expression" / NB06, [TWO_ANSWERS, "traffic_ring = " + "+".join(["1"] * 100_000)])
    shell = "\n".join(["x = !true " + "a" * 158] * 499)             # 84 KB, as the review's
    _write(klass / "magics" / NB06, [ANSWERS_06] + [shell + "\ntraffic_ring = traffic_ring"] * 11)
    _write(klass / "escapes" / NB06, [ANSWERS_06, ESCAPES + "\ntraffic_ring = traffic_ring"])
    _write(klass / "big_reply" / NB06, [ANSWERS_06, BIG_REPLY])
    _write(klass / "same\\file" / NB06, [ANSWERS_06])                 # both would be same_file.json
    _write(klass / "same_file" / NB06, [TWO_ANSWERS])
    return {"honest": (3, 3), "deep_json": (0, 3), "deep_expression": (2, 3), "magics": (0, 3), "escapes": (3, 3),
            "big_reply": (3, 3), "same\\file": (3, 3), "same_file": (2, 3)}


def _peak_memory(pid: int, peaks: list, done: threading.Event) -> None:
    """The judge's peak resident set (VmHWM), read from /proc until it ends."""
    while not done.is_set():
        try:
            for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peaks.append(int(line.split()[1]) * 1024)
        except OSError:
            return
        time.sleep(0.1)


@pytest.fixture(scope="module", params=["namespaces", "users"])
def run(request):
    isolation = request.param
    if isolation == "namespaces":
        _namespaces_or_fail()
    work = pathlib.Path(tempfile.mkdtemp(prefix="course_lib-bounds-"))
    expected = _class(work / "class")
    out = work / "grades"
    command = [sys.executable, "-m", "course_grader", "--class", str(work / "class"), "--out", str(out),
               "--isolation", isolation, "--jobs", "2", "--memory", "1G", "--disk", "256M", "--processes", "256",
               "--cell-timeout", "60", "--timeout", "300"]
    if isolation == "users":
        command = clean_machine(command)
    started = time.monotonic()
    judge = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=work,
                             env={**os.environ, "COURSE_LIB_GRADE_USER": USER})
    peaks, finished = [], threading.Event()
    watcher = threading.Thread(target=_peak_memory, args=(judge.pid, peaks, finished), daemon=True)
    watcher.start()
    stdout, stderr = judge.communicate(timeout=1200)
    finished.set()
    seconds = time.monotonic() - started
    results = {}
    for path in out.glob("*.json"):
        data = json.loads(path.read_text())
        results[data["submission"]] = data | {"file": path.name, "raw": path.read_text()}
    yield {"isolation": isolation, "returncode": judge.returncode, "stdout": stdout, "stderr": stderr,
           "results": results, "expected": expected, "seconds": seconds, "peak": max(peaks, default=0)}
    shutil.rmtree(work, ignore_errors=True)


def _notes(results) -> str:
    return "\n".join(t["output"] for t in results["tests"])


def test_the_class_finishes_with_every_student_graded_and_written(run):
    assert set(run["results"]) == set(run["expected"]), (run["stderr"][-3000:], sorted(run["results"]))
    for student, (score, possible) in run["expected"].items():
        results = run["results"][student]
        assert (results["score"], round(sum(t["max_score"] for t in results["tests"]), 2)) == (score, possible), \
            (student, results["output"], _notes(results)[:2000])
    assert "Traceback" not in run["stderr"], run["stderr"][-3000:]
    assert run["returncode"] == cli.EXIT_UNREADABLE, run["stderr"][-3000:]      # deep_json: not a notebook


def test_deep_json_and_a_deep_expression_cost_only_their_notebook(run):
    deep = run["results"]["deep_json"]
    assert deep["status"] == "unreadable" and "nested deeper" in deep["output"], deep["output"]
    expression = run["results"]["deep_expression"]
    assert expression["status"] == "graded", expression["output"]


def test_the_magics_notebook_is_refused_within_a_minute(run):
    magics = run["results"]["magics"]
    seconds = sum(n["seconds"] for n in magics["extra_data"]["notebooks"].values())
    assert magics["status"] == "too large" and seconds < 60, (magics["output"], seconds)
    assert "cell" in magics["output"] and "shell (!)" in magics["output"], magics["output"]


def test_escape_codes_are_shown_as_text_everywhere(run):
    for text in (run["stdout"], run["stderr"]):
        assert "\x1b" not in text and "\x9b" not in text and "\u202e" not in text
    escapes = run["results"]["escapes"]
    assert "\\x1b[2K" in _notes(escapes) and "\\r" in _notes(escapes), _notes(escapes)[:1000]
    for results in run["results"].values():
        strings = [results["output"]] + [t[k] for t in results["tests"] for k in ("name", "output")]
        assert not any(c in s for s in strings for c in "\x1b\r\x9b\u202e"), results["submission"]


def test_a_huge_reply_costs_the_judge_under_a_gigabyte(run):
    big = run["results"]["big_reply"]
    assert "cell 1" in _notes(big), _notes(big)[:2000]         # the cell that sent it was left out
    assert 0 < run["peak"] < 1 << 30, run["peak"]


def test_names_that_map_to_one_file_get_two_files(run):
    files = {student: results["file"] for student, results in run["results"].items()}
    assert len(set(files.values())) == len(files), files
    assert files["same_file"] == "same_file.json" and files["same\\file"].startswith("same_file-")


def test_the_table_a_cell_error_prints_cannot_be_forged(tmp_path):
    """One notebook, graded to the terminal: the forged rows stay inside the escaped note."""
    _namespaces_or_fail()
    notebook = _write(tmp_path / NB06, [ANSWERS_06, ESCAPES + "\ntraffic_ring = traffic_ring"])
    done = subprocess.run([sys.executable, "-m", "course_grader", str(notebook), "--isolation", "namespaces"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "COURSE_LIB_GRADE_USER": USER})
    assert done.returncode == cli.EXIT_OK, done.stderr[-2000:]
    assert "\x1b" not in done.stdout and "\r" not in done.stdout
    totals = [line for line in done.stdout.splitlines() if line.startswith("total")]
    assert len(totals) == 1 and "3/3" in totals[0], done.stdout


def test_two_names_for_one_file_that_cannot_be_told_apart_are_refused_before_grading():
    names = ["a\\b", "a_b"]
    files = cli._file_names(names)
    assert files["a_b"] == "a_b" and files["a\\b"] != "a_b"
    with pytest.raises(ValueError, match="would both be written"):
        cli._file_names(names + [files["a\\b"]])                  # a third chose the first one's file name


def test_the_reader_refuses_what_it_cannot_finish_and_names_the_cell():
    slow = "\n".join(["x = !true " + "a" * 158] * 499)
    started = time.monotonic()
    with pytest.raises(Exception, match=r"could not read cell \d+ within its limits") as refused:
        reading.plan(["import os"] + [slow] * 11, ["x"], positions=[1] + list(range(3, 25, 2)))
    assert time.monotonic() - started < reading.SECONDS + 10
    assert getattr(refused.value, "kind", None) == "too large"
    assert "cell 1 " not in str(refused.value)                  # one of the slow cells, not the first


def _work_folders(owners=None) -> set:
    """The judges' work folders in /tmp; with `owners`, only those of these judge processes (other tests may be
    grading beside this one)."""
    found = set()
    for folder in pathlib.Path(tempfile.gettempdir()).glob("course_lib-grad*-*"):
        try:
            owner = int((folder / "judge.pid").read_text())
        except (OSError, ValueError):
            continue
        if owners is None or owner in owners:
            found.add(folder)
    return found


def _group(leader: int) -> set:
    """The processes of the process group `leader` leads (the judge, and its wrapper where there is one)."""
    members = set()
    for entry in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            if os.getpgid(int(entry.name)) == leader:
                members.add(int(entry.name))
        except OSError:
            continue
    return members


def _user_processes(prefix: str, running: str = "") -> list:
    """The pids of processes whose user's name starts with `prefix` (and whose command line holds `running`)."""
    import pwd

    uids = {p.pw_uid for p in pwd.getpwall() if p.pw_name.startswith(prefix)}
    found = []
    for status in pathlib.Path("/proc").glob("[0-9]*/status"):
        try:
            uid = next(int(l.split()[1]) for l in status.read_text().splitlines() if l.startswith("Uid:"))
            if uid in uids and running in (status.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                found.append(status.parent.name)
        except (OSError, StopIteration):
            continue
    return found


KERNEL = "course_grader.kernel"          # what the sandbox runs: its kernel's command line


@pytest.mark.parametrize("isolation", ["namespaces", "users"])
def test_a_judge_stopped_from_outside_leaves_nothing_behind(tmp_path, isolation):
    """SIGTERM while a sandbox runs a cell: the judge ends within seconds, its sandboxes' processes and its work
    folders (the submissions' copies in them) are gone. SIGKILL cannot be caught: the next run removes what the
    killed judge left."""
    if isolation == "namespaces":
        _namespaces_or_fail()
    for student in ("slow_a", "slow_b"):
        _write(tmp_path / "class" / student / NB06, [ANSWERS_06, "import time\ntime.sleep(600)\nring_steps = ring_steps"])

    def start(klass="class"):
        command = [sys.executable, "-m", "course_grader", "--class", str(tmp_path / klass), "--out",
                   str(tmp_path / "grades"), "--isolation", isolation, "--jobs", "2"]
        if isolation == "users":
            command = clean_machine(command)
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
                                env={**os.environ, "COURSE_LIB_GRADE_USER": USER + "_stop"}, start_new_session=True)

    def wait_for_a_sandbox(judge):
        deadline = time.monotonic() + 120
        # The sandbox's kernel, not any process of its user: the judge's own access probe (`sandbox.exposed_to`)
        # also runs as that user for a moment, and on a busy machine long enough to be seen.
        while not _user_processes(USER + "_stop", KERNEL) and time.monotonic() < deadline and judge.poll() is None:
            time.sleep(0.5)
        if not _user_processes(USER + "_stop", KERNEL):
            if judge.poll() is None:
                os.killpg(judge.pid, signal.SIGKILL)
            raise AssertionError(f"no sandbox started: {judge.communicate()[1][-2000:]}")
        time.sleep(3)                                    # the cell is sleeping now
        return _group(judge.pid)

    judge = start()
    group = wait_for_a_sandbox(judge)
    assert _work_folders(group), "the judge made its work folder"
    stopped = time.monotonic()
    os.killpg(judge.pid, signal.SIGTERM)                  # as a terminal's close or a job's cancel: all of its group
    judge.communicate(timeout=60)
    assert time.monotonic() - stopped < 30
    assert _work_folders(group) == set()
    assert _user_processes(USER + "_stop") == []

    judge = start()
    group = wait_for_a_sandbox(judge)
    os.killpg(judge.pid, signal.SIGKILL)                  # nothing runs on the way out
    judge.communicate(timeout=60)
    left = _work_folders(group)
    assert left, "a killed judge leaves its folders (the next run removes them)"
    _write(tmp_path / "next" / "quick" / NB06, [ANSWERS_06])
    judge = start("next")                                 # the next run, with the same sandbox users
    _, stderr = judge.communicate(timeout=300)
    assert judge.returncode == cli.EXIT_OK, stderr[-2000:]
    assert not any(folder.exists() for folder in left)
    assert _user_processes(USER + "_stop") == []          # swept when the next run took its users


@pytest.mark.parametrize("isolation", ["namespaces", "users"])
def test_a_ring_that_never_returns_ends_with_the_notebooks_timeout(tmp_path, isolation):
    """--timeout 20 against a ring that never returns: the notebook's grading ends near its 20 s (it took 55.6 s),
    the exercise scored 0 with the reason."""
    if isolation == "namespaces":
        _namespaces_or_fail()
    never = ("import torch, torch.distributed as dist\n\ndef ring_scatter_reduce(tensor):\n"
             "    while True:\n        pass")
    _write(tmp_path / "class" / "spinner" / "04_ring_scatter_reduce.ipynb", [never])
    command = [sys.executable, "-m", "course_grader", "--class", str(tmp_path / "class"), "--out",
               str(tmp_path / "grades"), "--isolation", isolation, "--timeout", "20"]
    if isolation == "users":
        command = clean_machine(command)
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "COURSE_LIB_GRADE_USER": USER + "_spin"})
    seconds = time.monotonic() - started
    results = json.loads((tmp_path / "grades" / "spinner.json").read_text())
    graded = sum(n["seconds"] for n in results["extra_data"]["notebooks"].values())
    assert results["score"] == 0 and "ran out of its time" in _notes(results), _notes(results)[:2000]
    assert graded < 20 + 15, (graded, seconds, done.stderr[-2000:])
