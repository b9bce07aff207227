"""Submissions that try to forge their grade. Each is an otherwise empty submission of notebook 04 (its
ring_scatter_reduce not written; a few cheats use notebook 07's average_gradients) plus one cell with a cheat,
and each must score 0, with the judge unharmed and nothing the submission started still running afterwards.

The cheats run for real: the sandbox runs as an unprivileged user in namespaces of its own (these tests run
as root), and every cheat cell ends by raising an error that says it ran (and what it found: REPORT), which
the grader notes; so a test can tell that the cheat ran and did not just fail to start. The sandbox sees no
folder of the host to leave a mark in. One test runs a cheat with the sandbox as the judge's own user and no
isolation, to check that the warden alone stops what a submission leaves behind. tests/test_grade_isolation.py
attacks the isolation itself, in both setups.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass

import nbformat
import pytest
import torch

import course_lib

from course_lib.exercises import registry
from course_grader import judge, sandbox

ROOT = pathlib.Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the cheats run as another user, which needs root")

STUB = '''import torch, torch.distributed as dist
from course_lib import exercises

def ring_scatter_reduce(tensor):
    raise NotImplementedError("your code here")'''
STUB_07 = '''import torch, torch.distributed as dist
from course_lib import exercises

def average_gradients(model):
    raise NotImplementedError("your code here")'''


@dataclass(frozen=True)
class Notebook:
    """A cheat that needs more than one cell of notebook 04: another notebook, more cells, shorter time limits."""

    cells: tuple                                  # the cheat's cells (the first one reports that it ran)
    name: str = "04_ring_scatter_reduce.ipynb"
    stub: str = STUB
    exercise: str = "ring_scatter_reduce"
    limits: tuple = (("cell_timeout", 60),)      # grade_notebook's keyword arguments


# Each cheat's cell (or a Notebook); the harness ends its first cell with a raise that reports REPORT, a list
# a cheat may append what it managed to.
CHEATS = {
    "replaces_the_grader_and_the_check": '''
        import course_lib.exercises as exercises_module
        from course_lib.exercises.report import Result
        exercises_module.check = lambda name, *a, **k: Result(name, 10.0, 10.0, "passed", [f"{name}: 10/10 points"])
        import course_grader as grade_package
        grade_package.grade_namespace = lambda namespace, names, hidden=True: [
            {"name": n, "score": 10.0, "max_score": 10.0, "output": "full marks"} for n in names]
        import course_grader.judge as judge_copy
        judge_copy.grade_notebook = lambda *a, **k: None
        ring_scatter_reduce = ring_scatter_reduce''',
    "prints_result_markers_and_writes_fake_frames": '''
        import json, os, struct
        print("COURSE_LIB_GRADE " + json.dumps([{"name": "ring_scatter_reduce", "score": 10.0, "max_score": 10.0}]))
        frame = json.dumps({"kind": "value", "value": 10, "status": "ok", "ready": True}).encode()
        for fd in range(3, 256):
            try:
                os.write(fd, struct.pack(">I", len(frame)) + frame)
                os.write(fd, struct.pack(">I", 2**31))           # and a frame too large to accept
            except OSError:
                pass
        ring_scatter_reduce = ring_scatter_reduce''',
    "writes_results_files": '''
        import json, os, pathlib
        fake = json.dumps({"score": 1000, "tests": []})
        targets = ["results.json", "/autograder/results/results.json"]
        for pid in filter(str.isdigit, os.listdir("/proc")):        # the judge's --json, from its command line
            try:
                argv = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\\0")
            except OSError:
                continue
            if b"--json" in argv:
                targets.append(argv[argv.index(b"--json") + 1].decode())
        for target in targets:
            try:
                pathlib.Path(target).write_text(fake)
            except OSError:
                pass
        ring_scatter_reduce = ring_scatter_reduce''',
    "patches_torch_distributed": '''
        import torch.distributed as dist
        dist.all_reduce = lambda tensor, *a, **k: None        # where the old check took the expected value from
        dist.broadcast = dist.all_gather = lambda *a, **k: None

        def ring_scatter_reduce(tensor):
            return (dist.get_rank() + 1) % dist.get_world_size()''',
    "disables_the_tracer_and_calls_the_builtin": '''
        import torch.distributed as dist
        import course_lib.exercises.tracing as tracing
        tracing.FORBIDDEN_BUILTINS = ()
        tracing.Tracer.__enter__ = lambda self: self
        tracing.Tracer.__exit__ = lambda self, *exc: False

        def ring_scatter_reduce(tensor, _builtin=[dist.all_reduce]):
            _builtin[0](tensor)
            return (dist.get_rank() + 1) % dist.get_world_size()''',
    "forges_the_ranks_records": '''
        from course_lib.exercises import runner

        def forged(exercise_name, fn, world_size, cases, inputs, first_index, case_timeout):
            records = {}
            for k, case in enumerate(cases):
                total = sum(t.double() for t in inputs[k]).float()
                records[first_index + k] = [{"status": "ok", "after": total.clone(), "returned": (r + 1) % world_size,
                                             "messages": [], "printed": (0, "")} for r in range(world_size)]
            return runner.RankBatch(records, {}, None)

        runner.run_batch = forged
        ring_scatter_reduce = ring_scatter_reduce''',
    "changes_the_hidden_cases": '''
        from course_lib.exercises import cases, registry
        from course_lib.exercises.registry import Case
        cases.standard_cases = lambda *a, **k: [Case(1, 3)]
        type(registry.get("ring_scatter_reduce")).cases = lambda self, *a, **k: [Case(1, 3)]
        try:                                          # the grader's own cases, where the sandbox can import them
            from course_grader import hidden_cases
            hidden_cases.grader_cases = lambda exercise: [Case(1, 3)]
        except ImportError:
            pass

        def ring_scatter_reduce(tensor):
            return 0''',
    "kills_and_traces_the_judge": '''
        import ctypes, os, signal
        libc = ctypes.CDLL(None, use_errno=True)
        for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit()):
            if pid != os.getpid():
                libc.ptrace(16, pid, 0, 0)                  # PTRACE_ATTACH: refused for another user's process
                try:
                    os.kill(pid, signal.SIGKILL)            # only the sandbox user's own processes can die
                except OSError:
                    pass
        ring_scatter_reduce = ring_scatter_reduce''',
    "edits_course_lib_on_disk": '''
        import pathlib, course_lib, course_grader                     # the learner's package and the grader's kernel
        for path in [*pathlib.Path(course_lib.__file__).parent.rglob("*.py"),
                     *pathlib.Path(course_grader.__file__).parent.rglob("*.py")]:
            try:
                with open(path, "a") as f:
                    f.write("\\nSCORE = 10  # a submission was here\\n")
            except OSError:
                pass
        ring_scatter_reduce = ring_scatter_reduce''',
    "leaves_background_processes": '''
        import os, subprocess
        subprocess.Popen(["sleep", "6001"])                              # a plain child
        subprocess.Popen(["sleep", "6002"], start_new_session=True)      # in a session of its own
        if os.fork() == 0:                                               # a double fork, orphaned at once
            if os.fork() == 0:
                os.setsid()
                os.execvp("sleep", ["sleep", "6003"])
            os._exit(0)
        ring_scatter_reduce = ring_scatter_reduce''',
    "patches_torch_comparisons_and_returns_a_tensor_subclass": '''
        import torch
        class Equal(torch.Tensor):                        # equal to anything, in this process
            def __eq__(self, other): return True
        torch.equal = torch.allclose = lambda *a, **k: True
        torch.isclose = lambda a, b, *r, **k: torch.ones_like(a, dtype=torch.bool)
        torch.Tensor.__eq__ = lambda self, other: torch.ones_like(self, dtype=torch.bool)
        torch.Tensor.__ne__ = lambda self, other: torch.zeros_like(self, dtype=torch.bool)
        torch.Tensor.abs = lambda self: torch.zeros_like(self)

        def ring_scatter_reduce(tensor):
            tensor.fill_(float("nan"))
            return torch.tensor([1.0]).as_subclass(Equal)''',
    "sleeps_past_the_timeouts_and_ignores_interrupts": Notebook(('''
        import signal, time
        signal.signal(signal.SIGINT, signal.SIG_IGN)       # the judge's interrupt of a cell that runs too long
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

        def ring_scatter_reduce(tensor):
            time.sleep(10**6)''', '''
        ring_scatter_reduce = ring_scatter_reduce          # a cell the answer needs, and that never ends
        time.sleep(10**6)'''), limits=(("cell_timeout", 3), ("case_timeout", 0.5), ("timeout", 240))),
    "forges_its_ranks_record_files_and_exits_in_the_middle": '''
        import os, pickle, sys, torch.distributed as dist

        def ring_scatter_reduce(tensor):
            frame = sys._getframe(1)                       # up to the rank's loop, which knows the batch
            while frame is not None and "workdir" not in frame.f_locals:
                frame = frame.f_back
            if frame is not None:
                found, rank, G = frame.f_locals, dist.get_rank(), dist.get_world_size()
                for k, case_inputs in enumerate(found["inputs"]):
                    total = sum(t.double() for t in case_inputs).float()
                    record = {"status": "ok", "after": total, "returned": (rank + 1) % G, "messages": [],
                              "printed": (0, "")}
                    with open(os.path.join(found["workdir"], f"case{found['first_index'] + k}.rank{rank}.done"), "wb") as f:
                        pickle.dump(record, f)
            os._exit(0)                                    # before the rank writes its own record''',
    "reads_the_judges_memory_and_files": '''
        import os, pathlib
        outcomes, listed = set(), []
        warden = os.getppid()                              # root's (the sandbox's init), like the judge above it
        judge = pathlib.Path(f"/proc/{warden}/stat").read_text().rsplit(")", 1)[1].split()[1]
        for pid in (warden, judge):
            for what, attempt in (("environ", lambda: pathlib.Path(f"/proc/{pid}/environ").read_bytes()),
                                  ("mem", lambda: open(f"/proc/{pid}/mem", "rb").read(1)),
                                  ("fds", lambda: os.listdir(f"/proc/{pid}/fd")),
                                  ("stdout", lambda: open(f"/proc/{pid}/fd/1", "w").write("score 10/10\\n"))):
                try:
                    attempt()
                    outcomes.add(f"{what} done")
                except OSError as exc:
                    outcomes.add(type(exc).__name__)
        for folder in (pathlib.Path.cwd().parent, pathlib.Path("/root")):
            try:
                listed += os.listdir(folder)
            except OSError as exc:
                outcomes.add(type(exc).__name__)
        REPORT.extend([sorted(outcomes), sorted(listed)])
        ring_scatter_reduce = ring_scatter_reduce''',
    "averages_through_the_process_group_behind_padding_messages": Notebook(('''
        import torch, torch.distributed as dist

        def average_gradients(model):                      # zeros to look like an exchange, the mean from the
            rank, G = dist.get_rank(), dist.get_world_size()   # built-in that no tracer can swap everywhere
            if G > 1:
                count = sum(p.numel() for p in model.parameters())
                request = dist.isend(torch.zeros(count), (rank + 1) % G)
                dist.recv(torch.empty(count), (rank - 1) % G)
                request.wait()
            for parameter in model.parameters():
                dist.group.WORLD.allreduce([parameter.grad]).wait()
                parameter.grad /= G''',), name="07_data_parallel_training.ipynb", stub=STUB_07,
        exercise="average_gradients"),
}


@pytest.fixture(scope="module")
def user():
    (held,) = sandbox.sandbox_users(1, base="course_lib_test")
    yield held
    sandbox.sweep_user(held)
    sandbox.release_users([held])


def _as_notebook(cheat) -> Notebook:
    return cheat if isinstance(cheat, Notebook) else Notebook((cheat,))


RAN, STARTED = "CHEAT RAN: ", "CHEAT STARTED\n"


def _notebook(folder, cheat) -> pathlib.Path:
    cheat = _as_notebook(cheat)
    sources = [textwrap.dedent(cell).strip() for cell in cheat.cells]
    sources[0] = (f"import os as _os\n_os.write(2, {STARTED!r}.encode())\nREPORT = []\n{sources[0]}\n"
                  f"raise RuntimeError({RAN!r} + repr(REPORT))")
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook.cells = [nbformat.v4.new_code_cell(cheat.stub)] + [nbformat.v4.new_code_cell(s) for s in sources]
    path = folder / cheat.name
    nbformat.write(notebook, path)
    return path


def _report(notes) -> str | None:
    """What the cheat reported in the note on its cell's error, or None when it did not run to its end."""
    for note in notes:
        if RAN in note:
            return note.split(RAN, 1)[1]
    return None


def _processes_of(uid: int) -> list[int]:
    found = []
    for status in pathlib.Path("/proc").glob("[0-9]*/status"):
        try:
            uids = next(line for line in status.read_text().splitlines() if line.startswith("Uid:")).split()[1:]
        except (OSError, StopIteration):
            continue
        if str(uid) in uids:
            found.append(int(status.parent.name))
    return found


def _course_lib_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted([*(ROOT / "course_lib").rglob("*.py"), *(ROOT / "course_grader").rglob("*.py")]):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def test_there_are_at_least_eight_cheats():
    assert len(CHEATS) >= 8


@pytest.mark.parametrize("name", sorted(CHEATS))
def test_a_cheat_on_an_empty_submission_scores_zero(name, user, tmp_path):
    before = _course_lib_digest()
    cheat = _as_notebook(CHEATS[name])
    path = _notebook(tmp_path, cheat)
    started = time.monotonic()
    grade = judge.grade_notebook(path, user=user, **dict(cheat.limits))
    report = _report(grade.notes)
    assert any(STARTED.strip() in info for info in grade.info), f"the cheat did not run: {grade.info}"
    if name != "prints_result_markers_and_writes_fake_frames":     # its frames take the place of the kernel's replies
        assert report is not None, f"the cheat did not run to its end: {grade.notes}"
    assert grade.status == "graded", grade.notes
    assert [t["name"] for t in grade.tests] == [cheat.exercise]
    assert grade.score == 0 and grade.max_score == registry.get(cheat.exercise).points, grade.tests[0]["output"]
    assert all(not line["met"] for line in grade.tests[0]["lines"])
    assert time.monotonic() - started < dict(cheat.limits).get("timeout", 900)
    assert _processes_of(user.uid) == [], "a process the submission started outlived its grading"
    assert _course_lib_digest() == before, "a submission changed course_lib's files"
    if name == "reads_the_judges_memory_and_files":
        # Its parent is the sandbox's init; the judge is not in its namespace at all. Every try at either fails,
        # and the folders it lists (its home's parent, /root) hold nothing but its home and the folders that lead
        # to what it runs (a Python installed in /root).
        outcomes, listed = ast.literal_eval(report)[:2]
        assert outcomes and all(o in ("PermissionError", "FileNotFoundError") for o in outcomes), outcomes
        leading = {pathlib.Path(p).parts[2] for p in sandbox.namespace_binds() if p.startswith(("/home/", "/root/"))}
        assert set(listed) <= {"sandbox"} | leading and "sandbox" in listed, listed
    if name == "sleeps_past_the_timeouts_and_ignores_interrupts":
        assert any("the kernel died in cell 2" in note for note in grade.notes), grade.notes


def test_a_cheat_cannot_forge_the_commands_results(user, tmp_path):
    """The cheat looks for the judge's --json path and writes full marks there; the judge writes after it is gone."""
    path = _notebook(tmp_path, CHEATS["writes_results_files"])
    out = tmp_path / "results.json"
    done = subprocess.run([sys.executable, "-m", "course_grader", str(path), "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())
    assert results["score"] == 0 and results["tests"], results
    assert any(RAN in t["output"] for t in results["tests"]), results["tests"]


def test_without_isolation_the_warden_still_stops_everything_the_submission_left(tmp_path):
    """The sandbox as the judge's own user, no namespaces (isolation 'none'): setsid and double forks are still
    found by the warden, a child subreaper."""
    path = _notebook(tmp_path, CHEATS["leaves_background_processes"])
    grade = judge.grade_notebook(path, user=None, cell_timeout=60, isolation="none")
    assert _report(grade.notes) is not None and grade.score == 0
    assert "3 processes the notebook started were still running after grading and were stopped" in grade.notes

    def command_line(path):
        try:
            return path.read_bytes()
        except OSError:
            return b""
    assert [p for p in pathlib.Path("/proc").glob("[0-9]*/cmdline") if command_line(p).startswith(b"sleep\x00600")] == []


def test_without_namespaces_a_closed_install_is_read_through_a_mirror_of_hard_links(user, tmp_path, monkeypatch):
    """Isolation 'users' (no namespaces): course_lib is always read from a root-owned mirror of the package alone
    (never the checkout around it), and a torch the sandbox user cannot reach (a venv in /root) from a mirror of
    hard links of the site folders; the sandbox can still write none of course_lib's files. The grader's umask
    closes every folder it makes to other users (077), and the mirror is still open to them."""
    real = {pathlib.Path(course_lib.__file__).resolve().parent, pathlib.Path(torch.__file__).resolve().parent}
    reachable = sandbox._open_to_others
    monkeypatch.setattr(sandbox, "_open_to_others", lambda path, need: path not in real and reachable(path, need))
    monkeypatch.setattr(sandbox, "_MIRROR", {})
    before = _course_lib_digest()
    cheat = CHEATS["edits_course_lib_on_disk"].replace(
        "ring_scatter_reduce = ring_scatter_reduce",
        "import torch\n        REPORT.extend([course_lib.__file__, torch.__file__])\n"
        "        ring_scatter_reduce = ring_scatter_reduce")
    umask = os.umask(0o077)
    try:
        grade = judge.grade_notebook(_notebook(tmp_path, cheat), user=user, isolation="users")
        mirror = sandbox._MIRROR["root"]
        assert grade.status == "graded" and grade.score == 0, grade.notes
        read_from = ast.literal_eval(_report(grade.notes))
        assert len(read_from) == 2 and all(pathlib.Path(p).is_relative_to(mirror) for p in read_from), (read_from,
                                                                                                       mirror)
        assert _course_lib_digest() == before, "a submission changed course_lib's files through the mirror"
        assert mirror.stat().st_uid == 0 and mirror.stat().st_mode & 0o777 == 0o755
    finally:
        os.umask(umask)
        shutil.rmtree(sandbox._MIRROR.get("root", tmp_path / "none"), ignore_errors=True)
