"""Isolation "users" (no namespaces) holds like namespaces, or the grader refuses to run (issue 40, point 2).

Three breaks of the review, rebuilt as a hostile student (or a careless instructor) would:

* **The git route.** The grader's refusal once advised `chmod 700` on the checkout's notebooks/ and tests/;
  after that a submission found the checkout from the editable install's finder file in site-packages and ran
  `git -c safe.directory=* show HEAD:notebooks/04_ring_scatter_reduce.ipynb`: 10/10. Now a checkout the sandbox
  user can enter (its .git included) stops the grader before any submission runs, and the advice is to close the
  whole checkout; so closed, the same notebook scores 0.
* **A nested world-writable folder.** 500 MiB written into a root-owned 1777 folder inside /tmp (as /tmp/.X11-unix
  is) passed against `--disk 256M`: the warden counted only the top of each world-writable folder.
* **Empty files.** 150,000 of them, no byte each, passed as well. Now a file limit (inodes) holds: the warden
  counts every entry the sandbox user owns (a tmpfs of that many inodes with namespaces).

Each attack is one student of one class graded by one `--class` run per isolation mode, as in
tests/test_grade_isolation.py (whose `clean_machine` gives the users mode the README's machine: this checkout
closed to other users). Afterwards nothing of the sandbox user's is left anywhere.
"""

from __future__ import annotations

import json
import os
import pathlib
import pwd
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from course_grader import sandbox
from test_grade_isolation import (ANSWERS_06, ROOT, STUB_04, _attack, _namespaces_or_fail, _notes, _report, _write,
                                  clean_machine)

USER = "course_lib_usersmode"
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandboxes run as other users, which needs root")
NB04, NB06 = "04_ring_scatter_reduce.ipynb", "06_ring_cost.ipynb"

ATTACK_GIT_ROUTE = '''
    import glob, json, os, pathlib, re, subprocess, sys
    candidates = [pathlib.Path(p) for p in pathlib.Path(__import__("course_lib").__file__).resolve().parents]
    for folder in sys.path:                                        # the editable install's finder, .pth files
        for path in glob.glob(os.path.join(folder or ".", "*")):
            if re.search(r"(__editable__.*finder\\.py|\\.pth|\\.egg-link)$", path):
                try:
                    text = open(path, errors="replace").read()
                except OSError:
                    continue
                candidates += [pathlib.Path(p) for p in re.findall(r"(/[^'\\"\\s:]+)", text)]
    tried, executed, said = set(), [], {}
    for candidate in candidates:
        for base in [candidate, *candidate.parents][:4]:
            if base in tried:
                continue
            tried.add(base)
            for how in (["-C", str(base)], ["--git-dir", str(base / ".git")]):
                try:
                    done = subprocess.run(["git", "-c", "safe.directory=*", *how, "show",
                                           "HEAD:notebooks/04_ring_scatter_reduce.ipynb"],
                                          capture_output=True, text=True, timeout=20)
                except (OSError, subprocess.TimeoutExpired) as exc:
                    said[str(base)] = type(exc).__name__
                    continue
                if done.returncode != 0:
                    said.setdefault(str(base), done.stderr.strip()[:100])
                    continue
                for cell in json.loads(done.stdout)["cells"]:
                    source = "".join(cell["source"])
                    if "def ring_scatter_reduce" in source and "BEGIN SOLUTION" in source:
                        exec(source, globals())
                        executed.append(str(base))
                break
    REPORT.extend([len(tried), executed, {CHECKOUT: said.get(CHECKOUT, "not tried")}])'''

ATTACK_NESTED_FOLDER = '''
    import os
    folder = NESTED                                                # root's, mode 1777, inside /tmp
    os.makedirs(folder, exist_ok=True)                             # (with namespaces: not there, made in its /tmp)
    written = 0
    for index in range(10):                                        # 500 MiB, 50 MiB a file
        with open(os.path.join(folder, f"fill{index}"), "wb") as f:
            for _ in range(50):
                f.write(b"1" * (1 << 20))
                written += 1
    REPORT.append(f"wrote {written} MiB")'''

ATTACK_EMPTY_FILES = '''
    import os, time
    started, made = time.time(), 0
    os.makedirs("/tmp/course_lib_empty", exist_ok=True)            # (its own folder: /tmp's would stay 3 MB large)
    for index in range(150_000):                                   # no byte each
        try:
            open(f"/tmp/course_lib_empty/{index}", "w").close()
            made += 1
        except OSError as exc:
            REPORT.append(type(exc).__name__)
            break
    REPORT.extend([made, round(time.time() - started, 1)])'''


def _sandbox_uids() -> set:
    return {p.pw_uid for p in pwd.getpwall() if p.pw_name.startswith(USER)}


@pytest.fixture(scope="module", params=["namespaces", "users"])
def attacks(request):
    """The class of this module's attacks graded in one command, in the setup `request.param`."""
    isolation = request.param
    if isolation == "namespaces":
        _namespaces_or_fail()
    work = pathlib.Path(tempfile.mkdtemp(prefix="course_lib-usersmode-"))
    nested = pathlib.Path(tempfile.mkdtemp(prefix="course_lib-x11-", dir="/tmp"))    # as /tmp/.X11-unix is
    nested.chmod(0o1777)
    klass = work / "class"
    _write(klass / "git_route" / NB04, [STUB_04, _attack(ATTACK_GIT_ROUTE.replace("CHECKOUT", repr(str(ROOT))),
                                                         "ring_scatter_reduce")])
    nested_attack = ATTACK_NESTED_FOLDER.replace("NESTED", repr(str(nested)))
    _write(klass / "nested_folder" / NB06, [ANSWERS_06, _attack(nested_attack, "traffic_ring")])
    _write(klass / "empty_files" / NB06, [ANSWERS_06, _attack(ATTACK_EMPTY_FILES, "traffic_ring")])
    out = work / "grades"
    command = [sys.executable, "-m", "course_grader", "--class", str(klass), "--out", str(out), "--isolation",
               isolation, "--jobs", "2", "--memory", "1G", "--disk", "256M", "--processes", "256", "--cell-timeout",
               "180", "--timeout", "600"]
    # (A cell timeout well above the attacks' time: on a loaded machine /tmp on disk made ~1,000 files a second,
    # and the file limit, not the timeout, must be what stops it.)
    if isolation == "users":
        command = clean_machine(command)
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=work,
                          env={**os.environ, "COURSE_LIB_GRADE_USER": USER})
    seconds = time.monotonic() - started
    results = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")} if out.is_dir() else {}
    left = {uid: sandbox.left_behind(uid) for uid in _sandbox_uids()}
    nested_left = sorted(os.listdir(nested))
    yield {"isolation": isolation, "done": done, "results": results, "left": left, "seconds": seconds,
           "nested_left": nested_left}
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(nested, ignore_errors=True)


def _graded(attacks, student):
    done = attacks["done"]
    assert student in attacks["results"], f"no results for {student}: {done.stdout[-1500:]} {done.stderr[-3000:]}"
    results = attacks["results"][student]
    seconds = sum(n["seconds"] for n in results.get("extra_data", {}).get("notebooks", {}).values())
    print(f"{attacks['isolation']}: {student} scored {results['score']} in {seconds:.1f} s: {_report(results)}")
    return results


def test_the_git_route_to_a_closed_checkout_reads_nothing(attacks):
    """The checkout closed as the refusal now advises (chmod 700 on its root): the finder still names it, git
    cannot read it, and the notebook scores 0."""
    results = _graded(attacks, "git_route")
    report = _report(results)
    assert report is not None, _notes(results)
    tried, executed, said = report
    assert tried > 0 and executed == [], report
    if attacks["isolation"] == "users":            # the finder named the checkout; git could not enter it
        assert "Permission denied" in said[str(ROOT)], said
    assert results["score"] == 0, results["score"]


def test_500_mib_in_a_nested_world_writable_folder_reach_the_disk_limit(attacks):
    results = _graded(attacks, "nested_folder")
    notes = _notes(results)
    assert "cell 1" in notes and "disk limit (256 MiB)" in notes, notes
    assert results["score"] == 3, results["score"]
    assert attacks["nested_left"] == [], attacks["nested_left"]


def test_150000_empty_files_reach_the_file_limit(attacks):
    results = _graded(attacks, "empty_files")
    notes = _notes(results)
    assert "cell 1" in notes and "limit of 50,000 files" in notes, notes
    assert results["score"] == 3, results["score"]


def test_nothing_of_the_attacks_is_left(attacks):
    for uid, left in attacks["left"].items():
        assert left == {"processes": [], "ipc": [], "files": []}, (uid, left)
    assert not list(pathlib.Path("/tmp").glob("course_lib_empty*"))


def test_a_checkout_closed_only_in_notebooks_and_tests_stops_the_grader(tmp_path):
    """What the refusal once advised (chmod 700 on notebooks/ and tests/) is not enough: the checkout's .git still
    gives every solved notebook to git. The grader refuses to start, names the checkout and advises chmod 700 on
    it, saying why."""
    submission = _write(tmp_path / NB06, [ANSWERS_06])
    command = [sys.executable, "-m", "course_grader", str(submission), "--isolation", "users"]
    done = subprocess.run(clean_machine(command, close=False), capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**os.environ, "COURSE_LIB_GRADE_USER": USER})
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "could read" in done.stderr and str(ROOT) in done.stderr, done.stderr
    assert f"chmod 700 {ROOT}" in done.stderr and ".git" in done.stderr, done.stderr


# --------------------------------------------------------------------------------------------------
# The parts, quickly
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def user():
    (held,) = sandbox.sandbox_users(1, base=USER)
    yield held
    sandbox.sweep_user(held, files=True)
    sandbox.release_users([held])


def test_the_git_route_read_the_solutions_after_the_old_advice(user, tmp_path):
    """The control: the same attack, run as the sandbox user where only notebooks/ and tests/ are closed (what the
    refusal once advised), reads and runs the solved ring from the checkout's .git. This is what the refusal
    above now prevents."""
    import textwrap

    site = next(p for p in sys.path if p.endswith("site-packages") and pathlib.Path(p, "torch").is_dir())
    script = "REPORT = []\n" + textwrap.dedent(ATTACK_GIT_ROUTE.replace("CHECKOUT", repr(str(ROOT)))) + \
        "\nprint(repr(REPORT))"
    python = f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}"
    if not os.path.exists(python) or not os.access(site, os.R_OK) or ROOT.stat().st_mode & 0o005 != 0o005:
        pytest.skip("needs a system Python the sandbox user can run and a checkout open to other users")
    command = ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups", python, "-c", script]
    done = subprocess.run(clean_machine(command, close=False), capture_output=True, text=True, timeout=300,
                          cwd="/", env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{ROOT}:{site}",
                                        "HOME": str(tmp_path), "MPLCONFIGDIR": str(tmp_path / "mpl")})
    assert done.returncode == 0, done.stderr[-2000:]
    import ast

    tried, executed, said = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert str(ROOT) in executed, (executed, said)



@pytest.fixture
def open_folder():
    """A folder of root's in /tmp that every user may enter (pytest's tmp_path is below a folder of root's alone)."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="course_lib-open-", dir="/tmp"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_a_checkout_the_user_can_enter_is_exposed_even_if_it_cannot_list_it(user, open_folder):
    """`exposed_to(..., enter=True)`: a checkout of mode 711 gives .git/HEAD to whoever names it; 700 does not."""
    checkout = open_folder / "course"
    (checkout / "course_lib").mkdir(parents=True)
    (checkout / "course_lib" / "__init__.py").write_text("")
    subprocess.run(["git", "init", "-q", str(checkout)], check=True)
    enter, files = sandbox.private_parts(checkout)
    assert checkout in enter and checkout / ".git" in enter and checkout / ".git" / "HEAD" in files
    checkout.chmod(0o711)
    assert str(checkout) in sandbox.exposed_to(user, [checkout], enter=True)
    assert sandbox.exposed_to(user, [checkout]) == []          # it cannot list it, but it can enter it
    assert str(checkout / ".git" / "HEAD") in sandbox.exposed_to(user, files)
    checkout.chmod(0o700)
    assert sandbox.exposed_to(user, enter, enter=True) == [] and sandbox.exposed_to(user, files) == []


def test_users_usage_counts_nested_folders_empty_files_and_deleted_open_files(user, open_folder):
    """The warden's count without namespaces: everything the user owns below every world-writable folder (a
    root-owned 1777 one inside another too), each empty file as one file, a hard link once, and a file it deleted
    but holds open."""
    warden = sandbox._warden_module()
    top = pathlib.Path(tempfile.mkdtemp(prefix="course_lib-usage-", dir="/tmp"))
    try:
        top.chmod(0o1777)
        nested = top / "x11"
        nested.mkdir()
        nested.chmod(0o1777)
        home = open_folder / "home"
        home.mkdir()
        os.chown(home, user.uid, user.gid)
        script = f"""
import os
os.setgroups([]); os.setresgid({user.gid}, {user.gid}, {user.gid}); os.setresuid({user.uid}, {user.uid}, {user.uid})
with open({str(nested / 'big')!r}, 'wb') as f:
    f.write(b'1' * (4 << 20))
os.link({str(nested / 'big')!r}, {str(nested / 'big_again')!r})
for i in range(300):
    open(os.path.join({str(home)!r}, f'e{{i}}'), 'w').close()
os.mkdir({str(top / 'own')!r})
for i in range(200):
    open(os.path.join({str(top / 'own')!r}, f'e{{i}}'), 'w').close()
held = open({str(top / 'gone')!r}, 'wb')
held.write(b'2' * (3 << 20)); held.flush()
os.unlink({str(top / 'gone')!r})
print('ready', flush=True)
import sys
sys.stdin.read()
"""
        child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
        try:
            assert child.stdout.readline().strip() == "ready"
            folders = [str(top), str(nested)]
            used, files = warden.users_usage(user.uid, str(home), folders, pids=[child.pid])
            # home + 300 empty files; big (once); own/ + 200; the deleted file
            assert files == 1 + 300 + 1 + 1 + 200 + 1, files
            assert 7 << 20 <= used < 8 << 20, used
            # A world-writable folder the grader's walk did not list (made after it looked) is looked into too.
            unlisted = warden.users_usage(user.uid, str(home), [str(top)])
            assert unlisted[1] == files - 1, unlisted
            assert warden.users_usage(user.uid, str(home), folders, files=100)[1] <= 102    # stops once over
        finally:
            child.stdin.close()
            child.wait()
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_the_file_limit_is_part_of_the_limits():
    limits = sandbox.Limits()
    assert limits.files == 50_000 and "50,000 files" in limits.describe()
    assert sandbox.limit_words("files 50000") == "limit of 50,000 files"
