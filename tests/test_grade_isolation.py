"""Attacks on the grader's isolation (issue 26), each as a hostile student would try it, as root, in both setups:

* namespaces: the sandbox has mount, PID, IPC and network namespaces of its own (root on Linux);
* users: the fallback where namespaces are missing (a container without CAP_SYS_ADMIN, as on Gradescope),
  forced with --isolation users: a user of its own, one student at a time, a sweep after.

Every attack is one student of one class, graded by one `python -m course_grader --class` run per setup
(`battery`), with small limits (1 GiB of memory, 256 MiB of disk, 256 processes per notebook) so the limits are
reached fast. Each attack's cell ends by raising an error that reports what it found ("ATTACK [...]"); the
grader notes it, which tells the test that the attack ran and what it saw. Each test then checks the attack's
score is what its honest part earns (0 for a blank copy) and what it could not do; `test_nothing_is_left_behind`
checks, once the run is over, that no process, file, System V object, cgroup or mount of any sandbox remains.

The users setup's guarantee rests on permissions: the sandbox user must not be able to read the checkout's
notebooks/ and tests/, nor any solved notebook of the course anywhere on the machine (the grader walks every file
system and refuses to start otherwise). A clean clone in a mktemp folder on a machine of its own, as the README
says, gives that; a shared development machine may not (this checkout readable by everyone, other people's
copies in /tmp), so for that setup the test runs the grader in a private mount namespace of its own in which
those are covered (`clean_machine`): the machine the README describes. The namespaces setup needs no such help.
"""

from __future__ import annotations

import csv
import json
import os
import pathlib
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import time

import nbformat
import pytest

from course_grader import sandbox

ROOT = pathlib.Path(__file__).resolve().parent.parent
USER = "course_lib_battery"
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandboxes run as other users, which needs root")


def _namespaces_or_fail():
    ok, why = sandbox.namespaces_available()
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(f"CI must give the grader namespaces (root on Linux): {why}")
        pytest.skip(f"this machine gives no namespaces: {why}")


STUB_04 = '''import torch, torch.distributed as dist
from course_lib import exercises

def ring_scatter_reduce(tensor):
    raise NotImplementedError("your code here")'''
ANSWERS_06 = 'traffic_ring = "2*(G-1)*N"\ntraffic_ring_per_rank = "2(G-1)N/G"\nring_steps = "2(G-1)"'


def _solution(notebook: str, grade_id: str) -> str:
    cell = next(c for c in nbformat.read(ROOT / "notebooks" / notebook, as_version=4).cells
                if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id)
    return cell.source


RING_04 = "import torch, torch.distributed as dist\nfrom course_lib import exercises\n\n" + \
    _solution("04_ring_scatter_reduce.ipynb", "ring_scatter_reduce")
# What marks the honest students' rings as this class's: the attack on other students' work takes what carries it
# (a solved notebook some other user left readable elsewhere on the machine is not another submission).
CLASSMATE = "# a classmate's ring"


def _attack(source: str, rebind: str) -> str:
    """An attack cell: REPORT collects what it found, the answer's name is bound again (so grading runs the cell),
    and it ends by raising the report, which the grader notes."""
    return (f"REPORT = []\n{textwrap.dedent(source).strip()}\n{rebind} = {rebind}\n"
            "raise RuntimeError('ATTACK ' + repr(REPORT))")


ATTACK_SOLUTION_FROM_CHECKOUT = '''
    import os, json, pathlib, course_lib
    candidates = list(pathlib.Path(course_lib.__file__).resolve().parents)
    for pid in filter(str.isdigit, os.listdir("/proc")):           # every command line and environment it can read
        for what in ("cmdline", "environ"):
            try:
                words = open(f"/proc/{pid}/{what}", "rb").read().split(b"\\0")
            except OSError:
                continue
            for word in words:
                for part in word.decode(errors="replace").replace("=", ":").split(":"):
                    if part.startswith("/"):
                        candidates.append(pathlib.Path(part))
    tried, executed = set(), []
    for candidate in candidates:
        for base in [candidate, *candidate.parents]:
            notebook = base / "notebooks" / "04_ring_scatter_reduce.ipynb"
            if notebook in tried:
                continue
            tried.add(notebook)
            try:
                cells = json.loads(notebook.read_text())["cells"]
            except (OSError, ValueError):
                continue
            for cell in cells:
                source = "".join(cell["source"])
                if "def ring_scatter_reduce" in source and "BEGIN SOLUTION" in source:
                    exec(source, globals())
                    executed.append(str(notebook))
    REPORT.extend([len(tried), executed])'''

ATTACK_OTHER_STUDENTS = '''
    import os, json, pathlib, time
    CLASSMATE = CLASSMATE_MARK
    def places():
        found = {pathlib.Path.cwd(), pathlib.Path("/tmp"), pathlib.Path("/var/tmp"), pathlib.Path.home()}
        for pid in filter(str.isdigit, os.listdir("/proc")):      # the judge's --class folder, from /proc
            for what in ("cmdline", "environ"):
                try:
                    words = open(f"/proc/{pid}/{what}", "rb").read().split(b"\\0")
                except OSError:
                    continue
                for word in words:
                    for part in word.decode(errors="replace").replace("=", ":").split(":"):
                        if part.startswith("/"):
                            found.add(pathlib.Path(part))
            try:
                found.add(pathlib.Path(os.readlink(f"/proc/{pid}/cwd")))
            except OSError:
                pass
        return found
    own = (pathlib.Path.cwd() / "04_ring_scatter_reduce.ipynb").resolve()
    seen, executed, deadline = set(), 0, time.time() + 5
    while time.time() < deadline:                                  # while the others are being graded
        for place in places():
            for folder in [place, *place.parents][:4]:
                try:
                    notebooks = [*folder.glob("04_*.ipynb"), *folder.glob("*/04_*.ipynb"), *folder.glob("*/*/04_*.ipynb")]
                except OSError:
                    continue
                for notebook in notebooks:
                    if notebook.resolve() == own:
                        continue
                    try:
                        cells = json.loads(notebook.read_text())["cells"]
                    except (OSError, ValueError):
                        continue
                    for cell in cells:
                        source = "".join(cell["source"])
                        if CLASSMATE in source:                    # a classmate's ring: take it
                            seen.add(str(notebook))
                            exec(source, globals())
                            executed += 1
        time.sleep(0.5)
    REPORT.extend([sorted(seen)[:3], executed])'''.replace("CLASSMATE_MARK", repr(CLASSMATE))

ATTACK_OTHER_LOGS = '''
    import glob, os
    read = []
    for pattern in ("/tmp/course_lib-grading-*/*", "/tmp/course_lib-grading-*/*/*", "/tmp/course_lib-grade-*/*",
                    os.path.join(os.path.dirname(os.getcwd()), "*"), os.path.join(os.path.dirname(os.getcwd()), "*.log")):
        for path in glob.glob(pattern):
            if os.path.abspath(path).startswith(os.getcwd()):
                continue
            try:
                os.listdir(path) if os.path.isdir(path) else open(path, "rb").read(100)
                read.append(path)
            except OSError:
                pass
    for pid in filter(str.isdigit, os.listdir("/proc")):          # a log named on some command line
        try:
            words = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")
        except OSError:
            continue
        for word in words:
            if word.endswith(b".log") and word.startswith(b"/"):
                try:
                    open(word, "rb").read(100)
                    read.append(word.decode())
                except OSError:
                    pass
    REPORT.append(read[:3])'''

ATTACK_LOOPBACK = '''
    import pwd, socket, time
    sandbox_uids = {p.pw_uid for p in pwd.getpwall() if p.pw_name.startswith("course_lib")}
    listeners, connected, deadline = set(), 0, time.time() + 5
    while time.time() < deadline:                                  # while another student's ranks may be listening
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                rows = open(table).read().splitlines()[1:]
            except OSError:
                continue
            for row in rows:
                fields = row.split()
                if fields[3] == "0A" and int(fields[7]) in sandbox_uids:      # listening, a sandbox's
                    listeners.add(int(fields[1].rsplit(":", 1)[1], 16))
        for port in sorted(listeners):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                connected += 1
            except OSError:
                pass
        time.sleep(0.3)
    REPORT.extend([sorted(listeners)[:5], connected])'''

LEAKS = ("/tmp/course_lib_leak.py", "/var/tmp/course_lib_leak.py", "/dev/shm/course_lib_leak.py")
KEY = 0x26C0DE
_NUMBERS = sandbox._warden_module()._SYSCALLS.get(os.uname().machine, (0, {}))[1]
ADD_KEY, REQUEST_KEY, KEYCTL = (_NUMBERS.get(name, -1) for name in ("add_key", "request_key", "keyctl"))

ATTACK_PERSIST_WRITE = f'''
    import ctypes, inspect, os
    source = {RING_04!r}
    for path in {LEAKS!r}:
        try:
            with open(path, "w") as f:
                f.write(source)
            os.chmod(path, 0o666)
            REPORT.append("wrote")
        except OSError as exc:
            REPORT.append(type(exc).__name__)
    try:                                                           # memory pinned in /dev/shm
        with open("/dev/shm/course_lib_pinned", "wb") as f:
            for _ in range(150):
                f.write(b"1" * (1 << 20))
        REPORT.append("pinned")
    except OSError as exc:
        REPORT.append(type(exc).__name__)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    segment = libc.shmget({KEY}, 48 << 20, 0o1000 | 0o666)         # IPC_CREAT: a System V segment
    if segment >= 0:
        address = libc.shmat(segment, None, 0)
        data = source.encode() + b"\\0"
        ctypes.memmove(address, data, len(data))
        ctypes.memset(address + 65536, 1, (48 << 20) - 65536)
        REPORT.append("segment")
    payload = source.encode()                                      # the user's key ring, which outlives a process
    key = libc.syscall({ADD_KEY}, b"user", b"course_lib_leak", payload, len(payload), -4)
    REPORT.append("key" if key >= 0 else "key refused")'''

ATTACK_PERSIST_READ = f'''
    import ctypes, time
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    found, deadline = [], time.time() + 5
    while time.time() < deadline and not found:                    # whether it ran before, beside or after the writer
        for path in {LEAKS!r}:
            try:
                exec(open(path).read(), globals())
                found.append(path)
            except OSError:
                pass
        key = libc.syscall({REQUEST_KEY}, b"user", b"course_lib_leak", None, 0)
        if key >= 0:
            buffer = ctypes.create_string_buffer(1 << 16)
            size = libc.syscall({KEYCTL}, 11, key, buffer, 1 << 16)          # KEYCTL_READ
            exec(buffer.raw[:size].decode(), globals())
            found.append("key")
        segment = libc.shmget({KEY}, 0, 0)
        if segment >= 0:
            address = libc.shmat(segment, None, 0o10000)           # SHM_RDONLY
            if address not in (None, 2**64 - 1):
                exec(ctypes.string_at(address).decode(), globals())
                found.append("segment")
        time.sleep(0.5)
    REPORT.append(found)'''

ATTACK_MEMORY = '''
    import time
    chunks = []
    for _ in range(40):                                            # 4 GiB, 100 MB at a time, every page touched
        chunks.append(b"1" * (100 << 20))
        time.sleep(0.05)
    REPORT.append(len(chunks))'''

ATTACK_BIG_ALLOCATION = '''
    import torch
    big = torch.ones(2**31)                                        # 8 GiB at once
    REPORT.append(big.numel())'''

ATTACK_DISK = '''
    for index in range(8):                                         # 512 MB of files
        with open(f"/tmp/fill{index}", "wb") as f:
            for _ in range(64):
                f.write(b"1" * (1 << 20))
    REPORT.append("wrote 512 MB")'''

ATTACK_FORK_BOMB = '''
    import os, time
    children = 0
    for _ in range(3000):
        try:
            if os.fork() == 0:
                time.sleep(120)
                os._exit(0)
            children += 1
        except OSError:
            break
    time.sleep(1)
    REPORT.append(children)'''

ATTACK_KILL_ALL = '''
    import os, signal
    killed = 0
    for pid in [int(p) for p in os.listdir("/proc") if p.isdigit()]:
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
    try:
        os.kill(-1, signal.SIGKILL)                                # everything it may signal, but itself
    except OSError:
        pass
    REPORT.append(killed)'''


def _write(path: pathlib.Path, cells, name: str | None = None) -> pathlib.Path:
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, path)
    return path


def _class(work: pathlib.Path) -> pathlib.Path:
    """The class: one folder per attack (and the honest students they aim at). Returns its folder."""
    klass = work / "class"
    nb04, nb06 = "04_ring_scatter_reduce.ipynb", "06_ring_cost.ipynb"
    _write(klass / "a1_honest_ring" / nb04, [RING_04 + "\n" + CLASSMATE])
    _write(klass / "a2_loopback_ports" / nb04, [STUB_04, _attack(ATTACK_LOOPBACK, "ring_scatter_reduce")])
    _write(klass / "a3_other_students_work" / nb04, [STUB_04, _attack(ATTACK_OTHER_STUDENTS, "ring_scatter_reduce")])
    _write(klass / "persist_a_writer" / nb04, [RING_04, _attack(ATTACK_PERSIST_WRITE, "ring_scatter_reduce")])
    _write(klass / "persist_b_reader" / nb04, [STUB_04, _attack(ATTACK_PERSIST_READ, "ring_scatter_reduce")])
    (klass / "blank").mkdir()
    shutil.copy(ROOT / "assignments" / nb04, klass / "blank" / nb04)
    _write(klass / "solution_from_checkout" / nb04, [STUB_04, _attack(ATTACK_SOLUTION_FROM_CHECKOUT,
                                                                      "ring_scatter_reduce")])
    _write(klass / "other_sandboxes_logs" / nb04, [STUB_04, _attack(ATTACK_OTHER_LOGS, "ring_scatter_reduce")])
    for name, attack in (("memory_hog", ATTACK_MEMORY), ("big_allocation", ATTACK_BIG_ALLOCATION),
                         ("disk_filler", ATTACK_DISK), ("fork_bomb", ATTACK_FORK_BOMB), ("kill_all", ATTACK_KILL_ALL)):
        _write(klass / name / nb06, [ANSWERS_06, _attack(attack, "traffic_ring")])
    # Files that are not what they say: links (to another student, to a file only root may read), a pipe, a device.
    (klass / "link_to_student").mkdir()
    (klass / "link_to_student" / nb04).symlink_to(klass / "a1_honest_ring" / nb04)
    secret = work / "root_only"
    secret.mkdir(mode=0o700)
    _write(secret / nb04, [RING_04]).chmod(0o600)
    (klass / "link_to_root_file").mkdir()
    (klass / "link_to_root_file" / nb04).symlink_to(secret / nb04)
    (klass / "pipe_and_device").mkdir()
    os.mkfifo(klass / "pipe_and_device" / nb04)
    os.mknod(klass / "pipe_and_device" / nb06, 0o644 | stat.S_IFCHR, os.makedev(1, 5))        # /dev/zero's
    # Copies of one notebook (graded once), another assignment's exercise, a notebook far too large.
    for copy in (nb04, "old/" + nb04, "04_ring_scatter_reduce-Copy1.ipynb"):
        _write(klass / "duplicates" / copy, [RING_04])
    _write(klass / "foreign_exercise" / nb04, [STUB_04, _solution("00_hello_ranks.ipynb", "pass_token"),
                                               'exercises.check("pass_token", pass_token)'])
    (klass / "too_large").mkdir()
    (klass / "too_large" / nb06).write_text(json.dumps({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
        {"cell_type": "code", "id": f"c{i}", "metadata": {}, "execution_count": None, "outputs": [],
         "source": f"x{i} = {i}"} for i in range(60_000)]}))
    return klass


EXPECTED = {     # student: (score, max_score): what the honest part earns
    "a1_honest_ring": (10, 10), "a2_loopback_ports": (0, 10), "a3_other_students_work": (0, 10),
    "persist_a_writer": (10, 10), "persist_b_reader": (0, 10), "blank": (0, 10), "solution_from_checkout": (0, 10),
    "other_sandboxes_logs": (0, 10), "memory_hog": (3, 3), "big_allocation": (3, 3), "disk_filler": (3, 3),
    "fork_bomb": (3, 3), "kill_all": (3, 3), "link_to_student": (0, 10), "link_to_root_file": (0, 10),
    "pipe_and_device": (0, 13), "duplicates": (10, 10), "foreign_exercise": (0, 10), "too_large": (0, 3),
}


_CLEAN = '''
import os, subprocess, sys, tempfile
from course_grader import sandbox
root, how, leave, command = sys.argv[1], sys.argv[2], sys.argv[3].split("\\n"), sys.argv[4:]


def mount(*args, check=True):
    subprocess.run(["mount", *args], check=check, stderr=None if check else subprocess.DEVNULL)


made = []
try:
    if how == "close":
        # chmod 700 on the checkout, as the grader's refusal advises, without touching the real one (other people
        # use it meanwhile): an empty folder of root's alone over its parent, and the checkout bound back inside.
        stage = tempfile.mkdtemp(prefix="course_lib-clean-")
        made.append(stage)
        mount("--rbind", root, stage)
        mount("-t", "tmpfs", "-o", "size=64k,mode=0700", "none", os.path.dirname(root))
        os.mkdir(root)
        mount("--rbind", stage, root)
        if sys.prefix.startswith(root + "/"):
            # A virtual environment inside the checkout: the grader runs it from a folder every user may reach (as
            # a venv in /opt), since a bind mount (a mount of its own) cannot give a closed one's mirror hard links.
            place = tempfile.mkdtemp(prefix="course_lib-clean-venv-")
            os.chmod(place, 0o755)
            venv = os.path.join(place, "venv")
            os.mkdir(venv)
            made.insert(0, place)
            mount("--rbind", os.path.join(stage, os.path.relpath(sys.prefix, root)), venv)
            python = os.path.join(venv, os.path.relpath(sys.executable, sys.prefix))
            command = [python if word == sys.executable else word for word in command]
            if os.environ.get("COURSE_LIB_PYTHON") == sys.executable:      # Gradescope's run_autograder reads it
                os.environ["COURSE_LIB_PYTHON"] = python
        subprocess.run(["umount", "-l", stage], check=True)
    else:
        parent = os.path.dirname(root)
        if not os.stat(parent).st_mode & 0o001:
            # A clone in a mktemp folder (root's alone) is closed already: open its folder, as the machine the old
            # advice assumed had it (a tmpfs every user may enter over the parent, the checkout bound back inside).
            stage = tempfile.mkdtemp(prefix="course_lib-clean-")
            made.append(stage)
            mount("--rbind", root, stage)
            mount("-t", "tmpfs", "-o", "size=64k,mode=0755", "none", parent)
            os.mkdir(root)
            mount("--rbind", stage, root)
            subprocess.run(["umount", "-l", stage], check=True)
        for name in ("notebooks", "tests"):          # what the grader's refusal used to advise: not enough
            if os.path.isdir(os.path.join(root, name)):
                mount("-t", "tmpfs", "-o", "size=64k,mode=0700", "none", os.path.join(root, name))
    covered = []
    for repository in sandbox.course_repositories():  # other people's clones on a shared machine
        if repository != root and not repository.startswith(root + "/"):
            mount("-t", "tmpfs", "-o", "size=64k,mode=0700", "none", repository)
            covered.append(repository.rstrip("/") + "/")
    for path in sandbox.readable_solutions():
        if path not in leave and not path.startswith(tuple(covered)):
            mount("--bind", "/dev/null", path, check=False)    # (one removed meanwhile needs no cover)
    code = subprocess.run(command).returncode
finally:
    for folder in made:          # empty folders of the host's /tmp: the mounts on them are this namespace's
        for inner in (os.path.join(folder, "venv"), folder):
            subprocess.run(["umount", "-l", inner], stderr=subprocess.DEVNULL)
            try:
                os.rmdir(inner)
            except OSError:
                pass
sys.exit(code)
'''


def clean_machine(command: list, leave=(), close: bool = True) -> list:
    """`command` run as on the machine the README describes for grading without namespaces, in a private mount
    namespace of its own: this checkout closed to other users as `chmod 700` on it would (its parent covered by an
    empty folder of root's, the checkout bound back inside; its virtual environment, if inside, reachable elsewhere
    as a venv in /opt would be), other clones of the course any user could reach covered, and every other solved
    notebook any user could read (other people's copies on a shared machine) read empty. `close=False`: only
    notebooks/ and tests/ closed, as the grader's refusal once advised. The grader itself refuses to start where
    that is not so (`test_without_namespaces_a_readable_solution_...`, tests/test_grade_users_mode.py)."""
    return ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", _CLEAN, str(ROOT),
            "close" if close else "folders", "\n".join(map(str, leave)), *command]


def _sandbox_uids() -> set:
    return {p.pw_uid for p in pwd.getpwall() if p.pw_name.startswith(USER)}


@pytest.fixture(scope="module", params=["namespaces", "users"])
def battery(request):
    """One class of attacks graded in one command, in the setup `request.param`; the results and what was left."""
    isolation = request.param
    if isolation == "namespaces":
        _namespaces_or_fail()
    work = pathlib.Path(tempfile.mkdtemp(prefix="course_lib-battery-"))       # root's alone, as mktemp makes it
    klass = _class(work)
    out = work / "grades"
    command = [sys.executable, "-m", "course_grader", "--class", str(klass), "--out", str(out), "--isolation",
               isolation, "--jobs", "2", "--memory", "1G", "--disk", "256M", "--processes", "256", "--cell-timeout",
               "60", "--timeout", "300"]
    if isolation == "users":         # the README's machine: no solution any user could read
        command = clean_machine(command)
    shm_before = shutil.disk_usage("/dev/shm").used
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=work,
                          env={**os.environ, "COURSE_LIB_GRADE_USER": USER})
    seconds = time.monotonic() - started
    results = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")} if out.is_dir() else {}
    rows = list(csv.DictReader((out / "grades.csv").open())) if (out / "grades.csv").exists() else []
    left = {uid: sandbox.left_behind(uid) for uid in _sandbox_uids()}
    yield {"isolation": isolation, "done": done, "results": results, "rows": rows, "left": left, "work": work,
           "seconds": seconds, "shm_before": shm_before, "shm_after": shutil.disk_usage("/dev/shm").used}
    shutil.rmtree(work, ignore_errors=True)


def _notes(results: dict) -> str:
    return "\n".join(t["output"] for t in results["tests"] if t["name"].endswith(("notebook run", "submission: files")))


def _report(results: dict):
    """What the attack reported (the list its cell raised), or None when it did not run to its end."""
    import ast

    for line in _notes(results).splitlines():
        if "ATTACK [" in line:
            return ast.literal_eval(line.split("ATTACK ", 1)[1])
    return None


def _graded(battery, student):
    done = battery["done"]
    assert student in battery["results"], f"no results for {student}: {done.stdout[-1500:]} {done.stderr[-3000:]}"
    results = battery["results"][student]
    score, possible = EXPECTED[student]
    assert results["score"] == score, (student, results["score"], _notes(results), results["output"])
    assert round(sum(t["max_score"] for t in results["tests"]), 2) == possible, (student, results["tests"])
    return results


def test_the_run_grades_every_student_and_exits_3_for_the_refused_files(battery):
    done = battery["done"]
    assert done.returncode == 3, done.stderr[-3000:]                  # links, a pipe, a device, a notebook too large
    assert set(battery["results"]) == set(EXPECTED), done.stderr[-3000:]
    words = "grading with namespaces" if battery["isolation"] == "namespaces" else "grading without namespaces"
    assert words in done.stderr
    scores = {row["submission"]: float(row["score"]) for row in battery["rows"]}
    assert scores == {name: score for name, (score, _) in EXPECTED.items()}


def test_an_honest_ring_gets_full_marks_beside_the_attacks(battery):
    _graded(battery, "a1_honest_ring")
    _graded(battery, "blank")


def test_the_instructors_solutions_cannot_be_read(battery):
    """From course_lib.__file__ and every command line and environment in /proc, look for the checkout's
    notebooks/04 and exec its solution cell (this scored 10/10 on an empty copy)."""
    results = _graded(battery, "solution_from_checkout")
    tried, executed = _report(results)
    assert tried > 3 and executed == [], (tried, executed)


def test_other_students_submissions_cannot_be_read(battery):
    """The judge's --class folder from /proc, the working folder's neighbours, /tmp: any other 04 is read and its
    ring exec'd, for 5 s while the class is graded (this scored 10/10)."""
    results = _graded(battery, "a3_other_students_work")
    seen, executed = _report(results)
    assert seen == [] and executed == 0, seen


def test_other_sandboxes_logs_and_folders_cannot_be_read(battery):
    results = _graded(battery, "other_sandboxes_logs")
    assert _report(results) == [[]]


def test_no_loopback_port_of_another_submission_is_reachable(battery):
    """Scans the listening sockets of sandbox users for 5 s while the first honest student's ranks run beside it
    (with namespaces; without them no other student runs at the same time) and connects to each."""
    results = _graded(battery, "a2_loopback_ports")
    listeners, connected = _report(results)
    assert listeners == [] and connected == 0


def test_nothing_survives_from_one_submission_to_the_next(battery):
    """The writer leaves its ring in /tmp, /var/tmp, /dev/shm and a System V segment (and pins 150 MB in
    /dev/shm, 48 MB in the segment); the reader, graded next (or beside it), looks for 5 s and execs what it
    finds (this scored 10/10)."""
    writer = _graded(battery, "persist_a_writer")
    assert _report(writer) == ["wrote", "wrote", "wrote", "pinned", "segment", "key refused"]
    reader = _graded(battery, "persist_b_reader")
    assert _report(reader) == [[]]
    for path in LEAKS:
        assert not os.path.lexists(path), path
    assert not os.path.lexists("/dev/shm/course_lib_pinned")


def test_links_are_refused_never_followed(battery):
    """A link to another student's notebook (graded as the linker's: 10/40 before) and one to a file only root
    may read: both refused with a note, 0 points, nothing of theirs read."""
    for student in ("link_to_student", "link_to_root_file"):
        results = _graded(battery, student)
        assert "is a symbolic link: the grader does not follow links" in results["output"] + _notes(results)
        assert all(not line.startswith("met") for t in results["tests"] for line in t["output"].splitlines()[:1])


def test_pipes_and_devices_are_refused_without_hanging(battery):
    results = _graded(battery, "pipe_and_device")
    text = results["output"] + _notes(results)
    for name in ("04_ring_scatter_reduce.ipynb", "06_ring_cost.ipynb"):
        assert f"{name} is not a plain file" in text, text


def test_copies_of_a_notebook_are_graded_once(battery):
    """Three copies of a solved 04 (top, old/, -Copy1): 10 of 10, not 30 of 10; the feedback says which copy
    was graded and by what rule."""
    results = _graded(battery, "duplicates")
    notes = _notes(results)
    assert "graded in this notebook only" in notes and "not in this copy" in notes
    graded = {t["name"].split(":")[0] for t in results["tests"] if t["max_score"] > 0}
    assert graded == {"04_ring_scatter_reduce"}, graded


def test_another_assignments_exercise_scores_nothing(battery):
    """A 04 submission with notebook 00's pass_token solved and checked: 0 of 10 (5 of 15 before)."""
    results = _graded(battery, "foreign_exercise")
    assert "pass_token is an exercise of 00_hello_ranks" in _notes(results)
    assert not any(": pass_token:" in t["name"] for t in results["tests"])


@pytest.mark.parametrize("student, words", [("memory_hog", "memory limit (1 GiB)"),
                                            ("big_allocation", "memory limit"),
                                            ("disk_filler", "disk limit (256 MiB)"),
                                            ("fork_bomb", "limit of 256 processes and threads")])
def test_a_limit_ends_the_cell_with_a_note_and_the_rest_is_graded(battery, student, words):
    """The cell that reaches a limit is stopped, the feedback says which limit, and the answers (bound in an
    earlier cell) still earn their 3 points."""
    results = _graded(battery, student)
    notes = _notes(results)
    assert "cell 1" in notes and words in notes, notes


def test_killing_everything_it_can_reaches_nothing_of_the_grader(battery):
    """SIGKILL to every process it sees, then kill(-1): the grader (and with namespaces, everything outside the
    sandbox) is out of reach; the answers earn their points."""
    results = _graded(battery, "kill_all")
    report = _report(results)
    assert report is not None, _notes(results)
    if battery["isolation"] == "namespaces":
        assert report == [0]                  # it sees its init (root's) and itself: nothing it may kill


def test_a_notebook_of_60000_cells_is_refused_as_too_large(battery):
    results = _graded(battery, "too_large")
    assert "has 60,000 cells, more than the 2,000 the grader reads" in results["output"]


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def test_nothing_is_left_behind(battery):
    """No process, file, System V object of a sandbox user anywhere; no cgroup, mount or folder of the run; the
    space it used in /dev/shm free again."""
    for uid, left in battery["left"].items():
        assert left == {"processes": [], "ipc": [], "files": []}, (uid, left)
    # No sandbox's cgroup outlives its warden (whose pid names it), where the grader makes them: beside this
    # process's own cgroups, which the grader it started shares. Another test's grading may run beside this one
    # (pytest-xdist): its wardens are alive, and their cgroups are theirs to remove. (Other cgroups of the machine
    # belong to other process trees, in pid namespaces of their own: a pid there says nothing here.)
    leftover = sandbox._warden_module().sandbox_cgroups()
    orphaned = [p for p in leftover if not _alive(int(p.rsplit("-", 1)[1]))]
    assert not orphaned, orphaned
    assert "course_lib-grading-" not in pathlib.Path("/proc/self/mountinfo").read_text()
    assert battery["shm_after"] <= battery["shm_before"] + (32 << 20), (battery["shm_before"], battery["shm_after"])


def test_the_csv_opens_safely_and_has_a_row_per_student(battery):
    rows = battery["rows"]
    assert [row["submission"] for row in rows] == sorted(EXPECTED)
    assert all(not cell.startswith(("=", "+", "-", "@")) for row in rows for cell in row.values())


# --------------------------------------------------------------------------------------------------
# Without root
# --------------------------------------------------------------------------------------------------

ATTACK_AS_THE_GRADERS_USER = '''
    import os, subprocess
    for what, attempt in (("secret", lambda: open(SECRET).read()),
                          ("remount", lambda: subprocess.run(["mount", "-o", "remount,rw", COURSE_LIB],
                                                             capture_output=True).returncode),
                          ("write", lambda: open(os.path.join(COURSE_LIB, "planted.py"), "w").write("x")),
                          ("processes", lambda: len([p for p in os.listdir("/proc") if p.isdigit()])),
                          ("capabilities", lambda: next(l.split()[1] for l in open("/proc/self/status")
                                                        if l.startswith("CapEff")))):
        try:
            REPORT.append((what, attempt()))
        except OSError as exc:
            REPORT.append((what, type(exc).__name__))'''


def test_without_root_a_user_namespace_isolates_or_the_grader_refuses(tmp_path):
    """The grader run by an ordinary user (nobody): where the kernel allows user namespaces, the sandbox gets its
    namespaces all the same, runs without any capability, and cannot see that user's own files; where it does
    not, the grader refuses (exit 2, saying why and what to do) unless told --isolation none."""
    nobody = pwd.getpwnam("nobody")
    python, environment = sandbox.sandbox_python(sandbox.SandboxUser("nobody", nobody.pw_uid, nobody.pw_gid))
    home = pathlib.Path(tempfile.mkdtemp(prefix="course_lib-nobody-"))
    try:
        home.chmod(0o755)
        secret = home / "private.txt"
        secret.write_text("the grader's own file")
        course_lib_dir = pathlib.Path(environment["PYTHONPATH"].split(os.pathsep)[0]) / "course_lib"
        attack = ATTACK_AS_THE_GRADERS_USER.replace("SECRET", repr(str(secret))).replace(
            "COURSE_LIB", repr(str(course_lib_dir)))
        _write(home / "06_ring_cost.ipynb", [ANSWERS_06, _attack(attack, "traffic_ring")])
        for path in (home, secret, home / "06_ring_cost.ipynb"):
            os.chown(path, nobody.pw_uid, nobody.pw_gid)
        secret.chmod(0o600)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "MPLCONFIGDIR": str(home / ".mpl"),
               **environment}

        def as_nobody(*args):
            return subprocess.run(["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups",
                                   python, *args], capture_output=True, text=True, timeout=300, cwd=home, env=env)
        # The warden nobody's grader runs: the one in the course_grader it imports, beside course_lib (a mirror of
        # both, when the checkout is closed to other users, as a clone under mktemp -d is).
        probe = as_nobody(str(course_lib_dir.parent / "course_grader" / "_warden.py"), "--probe", "--userns")
        userns = probe.stdout.strip() == "ok"
        done = as_nobody("-m", "course_grader", "06_ring_cost.ipynb", "--json", "results.json")
        results_text = (home / "results.json").read_text()[-2000:] if (home / "results.json").exists() else ""
        why = (f"probe {probe.returncode} {probe.stdout.strip()[-300:]!r} {probe.stderr.strip()[-300:]!r}; "
               f"stderr {done.stderr[-1500:]}; results {results_text}")
        if not userns:
            assert done.returncode == 2 and "no isolation is available" in done.stderr, why
            done = as_nobody("-m", "course_grader", "06_ring_cost.ipynb", "--json", "results.json",
                             "--isolation", "none")
            assert done.returncode == 0 and "grading without isolation" in done.stderr, done.stderr[-2000:]
            return
        assert done.returncode == 0, done.stdout[-2000:] + why
        assert "grading with namespaces: each notebook runs as your user without any privilege" in done.stderr
        results = json.loads((home / "results.json").read_text())
        assert results["score"] == 3, results
        report = dict(_report(results))
        assert report["secret"] == "FileNotFoundError" and report["remount"] != 0 and report["write"] == "OSError"
        assert report["processes"] == 2 and int(report["capabilities"], 16) == 0, report
        assert not (course_lib_dir / "planted.py").exists()
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_the_sandbox_is_refused_key_rings_and_new_namespaces():
    """The seccomp filter every sandbox's kernel runs under: the kernel's key rings (a user's, shared by all its
    processes and outliving them) and making namespaces are refused; forks, threads and subprocesses work."""
    machine = os.uname().machine
    if sandbox._warden_module().seccomp_program(machine) is None:
        pytest.fail(f"no seccomp filter for {machine}: add its system call numbers to _warden._SYSCALLS")
    script = textwrap.dedent(f"""
        import ctypes, importlib.util, os, subprocess, threading
        spec = importlib.util.spec_from_file_location("warden", {sandbox.WARDEN!r})
        warden = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(warden)
        warden._prctl(warden.PR_SET_NO_NEW_PRIVS, 1)
        assert warden._seccomp()
        libc = ctypes.CDLL(None, use_errno=True)
        numbers = warden._SYSCALLS[os.uname().machine][1]
        out = []
        for name, args in (("keyctl", (0, -4, 0)), ("add_key", (b"user", b"k", b"v", 1, -4)), ("unshare", (0x10000000,))):
            out.append((name, libc.syscall(numbers[name], *args), ctypes.get_errno()))
        pid = os.fork()
        if pid == 0:
            os._exit(7)
        out.append(("fork", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])))
        thread = threading.Thread(target=lambda: out.append(("thread", 1)))
        thread.start()
        thread.join()
        out.append(("subprocess", subprocess.run(["true"]).returncode))
        print(out)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    import ast

    assert ast.literal_eval(done.stdout) == [("keyctl", -1, 1), ("add_key", -1, 1), ("unshare", -1, 1), ("fork", 7),
                                            ("thread", 1), ("subprocess", 0)]


def test_without_namespaces_a_readable_solution_anywhere_stops_the_grader(tmp_path):
    """A solved notebook of the course that any user may read (a copy left in a folder open to all): without
    namespaces a submission could read and run it, so the grader refuses to start, naming it and saying what to do."""
    exposed = pathlib.Path(tempfile.mkdtemp(prefix="course_lib-exposed-"))
    try:
        exposed.chmod(0o755)
        shutil.copy(ROOT / "notebooks" / "04_ring_scatter_reduce.ipynb", exposed / "my_copy.ipynb")
        (exposed / "my_copy.ipynb").chmod(0o644)
        submission = _write(tmp_path / "06_ring_cost.ipynb", [ANSWERS_06])
        command = [sys.executable, "-m", "course_grader", str(submission), "--isolation", "users"]
        done = subprocess.run(clean_machine(command, leave=[exposed / "my_copy.ipynb"]), capture_output=True, text=True,
                              timeout=300, cwd=tmp_path,
                              env={**os.environ, "COURSE_LIB_GRADE_USER": USER})
        assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
        assert "could read" in done.stderr and "my_copy.ipynb" in done.stderr and "chmod" in done.stderr, done.stderr
    finally:
        shutil.rmtree(exposed, ignore_errors=True)


def test_a_cgroup_left_by_a_killed_warden_is_removed_by_the_next_sandbox(tmp_path):
    """A grader killed with its warden leaves the sandbox's cgroups behind; starting the next sandbox removes every
    one whose warden no longer runs, and leaves a running warden's alone."""
    warden = sandbox._warden_module()
    mounts, own = warden._cgroup_mounts(), warden._own_cgroups()
    controller = next((c for c in ("pids", "memory", "unified") if c in mounts), None)
    if controller is None:
        pytest.skip("no cgroup file system mounted")
    parent = pathlib.Path(mounts[controller]) / own.get(controller, "/").lstrip("/")
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()                                              # a pid that no longer runs: a killed warden's
    stale, live = parent / f"{warden.CGROUP_PREFIX}{ended.pid}", parent / f"{warden.CGROUP_PREFIX}{os.getpid()}"
    try:
        stale.mkdir()
        live.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a cgroup here: {exc}")
    try:
        assert str(stale) in warden.sandbox_cgroups() and str(live) in warden.sandbox_cgroups()
        assert warden.remove_orphaned_cgroups() == []
        assert not stale.exists() and live.exists()           # this test's pid runs: its folder stays
    finally:
        for folder in (stale, live):
            if folder.exists():
                folder.rmdir()


def test_a_limit_the_warden_reports_late_still_names_the_limit():
    """On a busy machine the warden can see the OOM killer's work a second or more after the kernel's end of the
    channel closed (one CI run read "the kernel died in cell 1" for the memory hog): the judge waits for the
    warden's verdict instead of half a second."""
    read_from_kernel, write_from_kernel = os.pipe()
    os.close(write_from_kernel)                                  # the kernel is gone: its end of the channel closed
    warden = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5); print('limit memory 1 GiB', "
                               "flush=True); time.sleep(0.2); print('clean 0', flush=True)"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    box = sandbox.Sandbox(warden, -1, read_from_kernel, "/nonexistent", sandbox.Limits())
    try:
        with pytest.raises(sandbox.SandboxDied, match=r"memory limit \(1 GiB\)"):
            box._receive(timeout=30)
        assert box.limit_hit == "memory 1 GiB"
    finally:
        warden.kill()
        warden.wait()
        os.close(read_from_kernel)
        for stream in (warden.stdin, warden.stdout, warden.stderr):
            stream.close()


def test_the_warden_never_signals_a_pid_it_has_already_reaped(monkeypatch):
    """The warden reaps the sandbox's first process when it ends; by the time it kills what is left, that pid (and a
    process group of that number) may belong to another process: it signals it only while it is not yet reaped."""
    warden = sandbox._warden_module()
    childless = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])   # `me` with no descendants
    signalled = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: signalled.append(("kill", pid)))
    monkeypatch.setattr(os, "killpg", lambda pid, sig: signalled.append(("killpg", pid)))
    try:
        first = 2 ** 22 + 7                            # a pid number no process has (pid_max is at most 2**22)
        assert warden._kill_below(childless.pid, first) == 0
        assert signalled == [("killpg", first), ("kill", first)]       # not reaped yet: it and its group
        signalled.clear()
        warden._REAPED.add(first)
        assert warden._kill_below(childless.pid, first) == 0
        assert signalled == []
    finally:
        warden._REAPED.discard(first)
        monkeypatch.undo()
        childless.kill()
        childless.wait()


def test_the_sweep_finds_what_a_user_could_have_made_and_skips_folders_it_could_never_enter(tmp_path):
    """The sweep (`owned_files`) finds a user's entries wherever that user could have made them: in folders others
    may enter, or its group may; it does not read folders only their owner may enter (a closed checkout, a
    virtual environment in /tmp), as no entry of that user can be below one."""
    warden = sandbox._warden_module()
    uid, gid = 4_000_123, 4_000_123                          # a user and group no one has
    top = tmp_path / "shared"
    places = {"open": 0o711, "group": 0o710, "closed": 0o700}
    for name, mode in places.items():
        folder = top / name / "deeper"
        folder.mkdir(parents=True)
        (folder / "left.txt").write_text("x")
        os.chown(folder / "left.txt", uid, gid)
        os.chown(top / name, 0, gid if name == "group" else 0)
        os.chmod(top / name, mode)
    os.chmod(top, 0o1777)
    found, _ = warden.owned_files(uid, [str(top)])
    assert sorted(found) == [str(top / name / "deeper" / "left.txt") for name in ("group", "open")], found
    own = top / "closed" / "mine"
    own.mkdir()
    os.chown(own, uid, gid)                                  # a folder of its own: it could never have made it there
    assert str(own) not in warden.owned_files(uid, [str(top)])[0]
    os.chmod(top / "closed", 0o701)                          # others may enter: now it could have
    assert str(own) in warden.owned_files(uid, [str(top)])[0]
