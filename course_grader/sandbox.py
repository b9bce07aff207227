"""Sandboxes: a process tree of its own for every notebook being graded, seeing nothing but what grading needs.

    isolation = choose_isolation("auto")                  # 'namespaces', 'users' or 'none' (see below)
    box = Sandbox.start(stage, log_path, user, isolation=isolation, limits=Limits(), notebook=copy)
    box.request({"op": "cell", "source": "x = 1"}, timeout=300)     # -> the kernel's reply, as data
    box.interrupt()                                       # SIGINT to the kernel (a cell ran too long)
    box.stop()                                            # -> how many processes had to be killed

Who runs what (docs/architecture.md has the picture):

    judge (python -m course_grader)       never runs the submission's code; computes every score
      warden (_warden.py, one per notebook)  a child subreaper; holds the limits; kills everything at the end
        init (namespaces only)               PID 1 of the sandbox's namespaces: built its root, reaps
          kernel (kernel.py)                 the submission's cells, as the sandbox user, in a new session
            ranks (forked by course_lib.launch)  the learner's functions

Isolation, strongest first (`choose_isolation` picks the strongest the machine gives; `--isolation` or the
environment variable COURSE_LIB_GRADE_ISOLATION ask for one):

* **namespaces** (root on Linux, or a user the kernel allows user namespaces): mount, PID, IPC, network and
  UTS namespaces of its own. The sandbox's file system is read-only binds of Python, the packages, course_lib and
  this grader (nothing else of the host: not the repository, not the submissions, not the logs) and one tmpfs
  of `Limits.disk` bytes for /tmp, /var/tmp, /dev/shm and its home, which holds a copy of the notebook. Its
  /proc shows its own processes; its loopback is its own; its System V objects are its own. All of it goes
  when its last process ends. As root a cgroup holds memory (swap included) and processes and gives it a CPU
  share of its own; the kernel runs as an unprivileged user either way.
* **users** (root without namespaces: a container without CAP_SYS_ADMIN, as on Gradescope): each student
  graded gets an unprivileged user of its own (`sandbox_users`), students are graded one at a time (so no
  other submission's process or port exists while one runs), course_lib and this grader are read through a
  root-owned mirror, the grader refuses to start when that user could enter the instructor's checkout (its .git
  gives every solved notebook to git, whatever notebooks/ allows: `private_parts`) or any other clone of the
  course, or read any submission or solved notebook (`exposed_to`, tried as that user), and when a student is
  done everything the user owns is swept: processes, System V objects, files in every folder it could write
  (`sweep_user`). Limits: rlimits, and the warden's polling of the memory, processes, bytes and files (inodes)
  the sandbox uses, the last two over everything the user owns (`Limits`).

  Why not bubblewrap (or any other namespace tool) here: it needs the same kernel feature this mode is for
  machines without (user namespaces, or CAP_SYS_ADMIN); where it would run, `choose_isolation` picks
  "namespaces" already, which does what bubblewrap would. Nor a file system of the user's own for its writes:
  mounting one (or setting quotas) needs that privilege too, so the limits are counted instead.
* **none** (no root, no user namespaces): the kernel runs as the grader's own user. The score still cannot be
  forged (the judge computes it from data), but the submission can read and write whatever you can. Only on
  request (`--isolation none`).
"""

from __future__ import annotations

import os
import pathlib
import pwd
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from course_grader import channel

__all__ = ["Sandbox", "SandboxUser", "Limits", "SandboxError", "SandboxStartError", "SandboxDied", "SandboxTimeout",
           "IsolationError", "sandbox_users", "release_users", "sweep_user", "running_as_root", "choose_isolation",
           "namespaces_available", "exposed_to", "shared_dirs", "parse_size", "describe_isolation", "WARDEN",
           "ISOLATIONS", "DEFAULT_USER", "default_user", "checkouts", "SECRET_FOLDERS", "left_behind",
           "readable_solutions", "writable_dirs", "course_repositories", "private_parts", "git_dirs"]

WARDEN = str(pathlib.Path(__file__).with_name("_warden.py"))
DEFAULT_USER = "course_lib_grader"
ISOLATIONS = ("namespaces", "users", "none")
HOME = "/home/sandbox"            # the sandbox's home folder, inside its namespaces


class SandboxError(RuntimeError):
    """A sandbox could not be started, or broke the protocol."""


class SandboxStartError(SandboxError):
    """The sandbox could not be started at all: the grader's installation, not the submission, is at fault."""


class SandboxDied(SandboxError):
    """The kernel ended (a cell or an answer killed it, or it reached a limit) before it replied."""


class SandboxTimeout(SandboxError):
    """The kernel did not reply in time."""


class IsolationError(SandboxError):
    """The isolation asked for is not available here (the message says why and what to do)."""


@dataclass(frozen=True)
class SandboxUser:
    name: str
    uid: int
    gid: int


@dataclass(frozen=True)
class Limits:
    """What one sandbox (one notebook being graded) may use.

    memory: bytes of memory, all its processes together (the kernel, the ranks; with namespaces its tmpfs counts
        too). Default 4 GiB: grading the solutions of 00-11, notebook 11 (8 ranks) peaked at 1.4 GiB.
    disk: bytes it may write (its /tmp, /var/tmp, /dev/shm and home together). Default 1 GiB.
    processes: processes and threads, all together. Default 1024: grading the solutions peaked at 50.
    files: files and folders it may make (inodes: an empty file costs no byte, but one each). Default 50,000.

    With namespaces as root, a cgroup holds memory (swap included) and processes exactly, and the disk is a
    tmpfs of that size and that many inodes. Elsewhere each process has an address-space limit of `memory` +
    1 GiB (what torch maps without using it), files are at most `disk` bytes, the user's processes at most 4 x
    `processes`, and the warden adds up the sandbox's memory (proportional set size), processes, bytes and files
    twice a second and after every cell, and stops it when one is over. Without namespaces ("users") the bytes and
    files counted are everything the sandbox user owns: its own folder, all below every folder any user may
    write (nested ones, such as a root-owned 1777 folder inside /tmp, included) and the deleted files its
    processes still hold open.
    """

    memory: int = 4 << 30
    disk: int = 1 << 30
    processes: int = 1024
    files: int = 50_000

    def describe(self) -> str:
        return (f"memory {human(self.memory)}, disk {human(self.disk)}, {self.files:,} files, {self.processes} "
                "processes and threads")


def human(count: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size and count % (size // 16 or 1) == 0:
            return f"{count / size:g} {unit}"
    return f"{count:,} bytes"


def parse_size(text) -> int:
    """'4G', '512M', '1.5GiB', '100000' -> bytes.

    Raises:
        ValueError: not a size.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*", str(text).lower())
    if not match:
        raise ValueError(f"{text!r} is not a size: write it as 4G, 512M or a number of bytes")
    number, unit = float(match.group(1)), match.group(2)
    value = int(number * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[unit])
    if value <= 0:
        raise ValueError(f"{text!r} is not a size above 0")
    return value


def running_as_root() -> bool:
    return os.geteuid() == 0


def default_user() -> str:
    """The sandbox users' name: COURSE_LIB_GRADE_USER, else course_lib_grader (then ...1, ...2 when several)."""
    return os.environ.get("COURSE_LIB_GRADE_USER") or DEFAULT_USER


# --------------------------------------------------------------------------------------------------
# Which isolation this machine gives
# --------------------------------------------------------------------------------------------------

_PROBES: dict = {}


def namespaces_available() -> tuple[bool, str]:
    """(True, '') when a sandbox can have its own namespaces here (as root, or through a user namespace without
    root); else (False, why). Asked once per process."""
    if "result" not in _PROBES:
        command = [sys.executable, WARDEN, "--probe"] + ([] if running_as_root() else ["--userns"])
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=30)
            ok = done.returncode == 0 and done.stdout.strip() == "ok"
            why = "" if ok else (done.stdout.strip() or done.stderr.strip()[-300:] or f"exit {done.returncode}")
        except (OSError, subprocess.TimeoutExpired) as exc:
            ok, why = False, str(exc)
        _PROBES["result"] = (ok, why)
    return _PROBES["result"]


def choose_isolation(requested: str | None = "auto") -> str:
    """The isolation to grade with: `requested` ('auto', or one of ISOLATIONS), or the environment variable
    COURSE_LIB_GRADE_ISOLATION when `requested` is 'auto' or None.

    Raises:
        IsolationError: the isolation asked for (or, for 'auto', any) is not available; the message says why.
    """
    requested = requested or "auto"
    if requested == "auto":
        requested = os.environ.get("COURSE_LIB_GRADE_ISOLATION", "auto") or "auto"
    if requested not in ("auto", *ISOLATIONS):
        raise IsolationError(f"unknown isolation {requested!r}: choose auto, {', '.join(ISOLATIONS)}")
    if requested == "none":
        return "none"
    if requested == "users":
        if not running_as_root():
            raise IsolationError("isolation 'users' needs root (it runs each student as a user of its own)")
        return "users"
    ok, why = namespaces_available()
    if ok:
        return "namespaces"
    if requested == "namespaces":
        raise IsolationError(f"this machine gives no namespaces to the sandbox ({why})")
    if running_as_root():
        return "users"
    raise IsolationError(
        f"no isolation is available: not root, and no user namespaces ({why}). Grade as root (in a container if "
        "you like), or pass --isolation none to grade with the submissions running as you (they could then read "
        "and write your files)")


def describe_isolation(isolation: str) -> str:
    """One sentence for the grader's output: who runs the submissions and what they can see."""
    if isolation == "namespaces":
        who = (f"the unprivileged user {default_user()} (one per student graded at once)" if running_as_root()
               else "your user without any privilege")
        return (f"grading with namespaces: each notebook runs as {who} in mount, PID, IPC and network namespaces "
                "of its own, seeing course_lib and its packages read-only and a private temporary area only")
    if isolation == "users":
        return (f"grading without namespaces (this machine does not give them): each student runs as an unprivileged "
                f"user of its own ({default_user()}), one student at a time, and everything that user owns is "
                "removed after it")
    return ("grading without isolation: the submissions run as your own user. They cannot change their grades, "
            "but can read and write what you can")


# --------------------------------------------------------------------------------------------------
# Users
# --------------------------------------------------------------------------------------------------

_LOCKS = pathlib.Path("/tmp/course_lib-sandbox-users")


def _lock(name: str):
    """Hold user `name` for this grader (an flock, released when the process ends), or None when another grader
    holds it: two graders at once must not share a user, or each would kill the other's sandboxes."""
    import fcntl

    _LOCKS.mkdir(mode=0o700, exist_ok=True)
    info = _LOCKS.lstat()
    if info.st_uid != 0 or info.st_mode & 0o077 or not _LOCKS.is_dir() or _LOCKS.is_symlink():
        raise SandboxError(f"{_LOCKS} is not root's alone: remove it and grade again")
    handle = open(_LOCKS / f"{name}.lock", "w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        return None
    return handle


def sandbox_users(count: int, base: str = DEFAULT_USER) -> list[SandboxUser]:
    """`count` unprivileged users for sandboxes (base, base1, base2, ...: the first that no other grader on this
    machine holds), made with useradd when missing, and held until `release_users`.

    Only for a judge running as root; each student graded at the same time gets one, so one student's
    processes can neither touch another's nor survive into another's grading.

    Raises:
        SandboxError: a user is missing and cannot be made (no useradd).
    """
    users = []
    index = 0
    while len(users) < count:
        name = base if index == 0 else f"{base}{index}"
        index += 1
        lock = _lock(name)
        if lock is None:
            continue
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            useradd = shutil.which("useradd")
            if useradd is None:
                raise SandboxError(f"user {name} does not exist and there is no useradd to make it: create an "
                                   f"unprivileged user {name} (no home, no login shell) and grade again") from None
            done = subprocess.run([useradd, "--system", "--no-create-home", "--home-dir", "/nonexistent",
                                   "--shell", "/usr/sbin/nologin", "--user-group", name], capture_output=True, text=True)
            if done.returncode not in (0, 9):      # 9: made meanwhile by another grader
                raise SandboxError(f"could not create the sandbox user {name}: {done.stderr.strip()}")
            entry = pwd.getpwnam(name)
        if entry.pw_uid == 0:
            raise SandboxError(f"the sandbox user {name} is root: choose an unprivileged user")
        _HELD[name] = lock
        user = SandboxUser(name, entry.pw_uid, entry.pw_gid)
        sweep_user(user, files=True)     # whatever an earlier grader that crashed left running or lying as this user
        users.append(user)
    return users


_HELD: dict = {}


def release_users(users) -> None:
    """Let other graders use these sandbox users again (after `sweep_user` stopped what they ran)."""
    for user in users:
        handle = _HELD.pop(user.name, None)
        if handle is not None:
            handle.close()


_SHARED: dict = {}
# File systems no user writes files to (or that are not files at all).
_NOT_FILES = {"proc", "sysfs", "cgroup", "cgroup2", "devpts", "securityfs", "debugfs", "tracefs", "pstore", "bpf",
              "configfs", "fusectl", "binfmt_misc", "autofs", "nsfs", "efivarfs", "rpc_pipefs", "nfsd", "selinuxfs"}


def shared_dirs() -> list[str]:
    """Every folder any user may write into (world-writable and reachable: /tmp, /var/tmp, /dev/shm,
    /dev/mqueue, /run/lock, ...), found once per grader by walking every mounted file system; one below another
    is left out (a sweep walks all below each, but for folders it could never have entered). What a sandbox
    user writes outside its own folder can only be below one of these."""
    return _scan()["dirs"]


def writable_dirs() -> list[str]:
    """`shared_dirs` with the world-writable folders below them too (a root-owned 1777 folder inside /tmp, as
    /tmp/.X11-unix is): every folder the sandbox user may make an entry in besides its own. The warden counts what
    the user owns at the top of each of these, and all below it, as the sandbox's disk and files."""
    return _scan()["all_dirs"]


def readable_solutions() -> list[str]:
    """Solved notebooks of the course (a cell with nbgrader's "### BEGIN SOLUTION") that any user may read, anywhere
    on this machine (the same walk as `shared_dirs`): without namespaces, a submission could read and run them."""
    return _scan()["solutions"]


def course_repositories() -> list[str]:
    """Git repositories of the course that any user may reach (the same walk as `shared_dirs`): a checkout (a
    folder with a .git and course_lib) whose folder every user may enter, or a bare clone holding course_lib.
    Its objects hold every solved notebook, whatever notebooks/ allows: git reads them for anyone who can reach
    them (`git -c safe.directory=* show HEAD:notebooks/...`)."""
    scan = _scan()
    if "repositories" not in scan:
        found = [g for g in scan["git"] if _is_course_checkout(g)]
        found += [b for b in scan["bare"][:50] if _bare_course_repository(b)]
        scan["repositories"] = sorted(set(found))
    return scan["repositories"]


_SOLUTION_MARK = b"### BEGIN SOLUTION"


def _is_course_checkout(folder: str) -> bool:
    return os.path.isdir(os.path.join(folder, "course_lib")) and \
        os.path.isfile(os.path.join(folder, "course_lib", "__init__.py"))


def _bare_course_repository(folder: str) -> bool:
    """A bare git repository (HEAD, objects/, refs/) whose HEAD holds course_lib (asked of git, as root)."""
    git = shutil.which("git")
    if git is None:
        return True           # cannot tell: count it, the instructor can close it
    try:
        done = subprocess.run([git, "-c", "safe.directory=*", "--git-dir", folder, "cat-file", "-e", "HEAD:course_lib"],
                              capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return True
    return done.returncode == 0


def _scan() -> dict:
    """One walk of every mounted file system, through the folders any user may enter (o+x): the folders any user
    may write, the notebooks any user may read that hold solutions, and the course's git repositories any user
    may reach. Made once per grader."""
    if "scan" in _SHARED:
        return _SHARED["scan"]
    points = []
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and fields[2] not in _NOT_FILES:
                    points.append(fields[1].replace("\\040", " "))
    except OSError:
        points = ["/", "/tmp", "/var/tmp", "/dev/shm"]
    skip = {str(p) for p in mirror_folders()}
    writable, notebooks, seen, gits, bare = set(), [], set(), [], []
    for point in sorted(set(points)):
        try:
            device = os.lstat(point).st_dev
        except OSError:
            continue
        todo = [point]
        while todo:
            folder = todo.pop()
            try:
                info = os.lstat(folder)
            except OSError:
                continue
            if info.st_dev != device or (info.st_dev, info.st_ino) in seen or folder in skip:
                continue
            seen.add((info.st_dev, info.st_ino))
            if not info.st_mode & 0o001:          # no user but its owner and group may enter it
                continue
            if info.st_mode & 0o002:
                writable.add(folder)
            names = set()
            try:
                with os.scandir(folder) as entries:
                    for entry in entries:
                        names.add(entry.name)
                        if entry.is_dir(follow_symlinks=False):
                            todo.append(entry.path)
                        elif entry.name.endswith(".ipynb") and entry.is_file(follow_symlinks=False):
                            notebooks.append(entry)
            except OSError:
                continue
            if ".git" in names:
                gits.append(folder)
            elif {"HEAD", "objects", "refs"} <= names:
                bare.append(folder)
    solutions = []
    for entry in notebooks[:5000]:
        try:
            info = entry.stat(follow_symlinks=False)
            if info.st_mode & 0o004 and info.st_size < 64 << 20:
                with open(entry.path, "rb") as f:
                    if _SOLUTION_MARK in f.read():
                        solutions.append(entry.path)
        except OSError:
            continue
    bare = [b for b in bare if not any(b.startswith(g.rstrip("/") + "/") for g in gits)]
    # A world-writable folder below another is swept with it.
    dirs = sorted(d for d in writable if not any(d != w and d.startswith(w.rstrip("/") + "/") for w in writable))
    _SHARED["scan"] = {"dirs": dirs, "all_dirs": sorted(writable), "solutions": sorted(solutions),
                       "git": sorted(gits), "bare": sorted(bare)}
    return _SHARED["scan"]


def sweep_user(user: SandboxUser, files: bool = False, skip=(), processes: bool = True) -> tuple[int, int, int]:
    """Kill every process `user` still runs (as root), wherever it went; with `files`, also remove its System V
    IPC objects and every file it owns in the folders any user may write (`shared_dirs`); `processes=False`
    leaves its processes be (files and IPC objects only). Returns how many processes, IPC objects and files
    (top-most entries) there were."""
    folders = shared_dirs() if files else []
    skip = [*skip, *(str(p) for p in mirror_folders())]
    lines = "".join(f"{f}\n" for f in folders) + "".join(f"-{s}\n" for s in skip)
    command = [sys.executable, WARDEN, "--sweep-uid", str(user.uid)] + (["--folders"] if files else []) + \
        ([] if processes else ["--files-only"])
    done = subprocess.run(command, input=lines if files else "", capture_output=True, text=True, timeout=300)
    try:
        counts = [int(x) for x in done.stdout.split()[1:4]]
        return tuple(counts + [0] * (3 - len(counts)))
    except (IndexError, ValueError):
        raise SandboxError(f"could not clean up after {user.name}: {done.stderr.strip()[-300:]}") from None


def _warden_module():
    import importlib.util

    if "module" not in _SHARED:
        spec = importlib.util.spec_from_file_location("course_lib_grade_warden", WARDEN)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _SHARED["module"] = module
    return _SHARED["module"]


def left_behind(uid: int) -> dict:
    """What user `uid` still has (as root): {'processes': [pid], 'ipc': [(kind, id, bytes)], 'files': [path]}, the
    files looked for in every folder any user may write."""
    warden = _warden_module()
    files, _ = warden.owned_files(uid, shared_dirs(), {str(p) for p in mirror_folders()})
    return {"processes": warden._uid_processes(uid), "ipc": warden.ipc_objects(uid), "files": files}


def exposed_to(user: SandboxUser, paths, enter: bool = False) -> list[str]:
    """Which of `paths` (files or folders) `user` could open: tried for real by a child that becomes that user.

    enter: a folder also counts when `user` can only enter it (look up a name it knows in it, without listing
    it: a checkout of mode 711 still gives `.git/HEAD` and the objects to whoever names them).
    """
    paths = [str(p) for p in paths]
    if not paths:
        return []
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            os.setgroups([])
            os.setresgid(user.gid, user.gid, user.gid)
            os.setresuid(user.uid, user.uid, user.uid)
            out = []
            for index, path in enumerate(paths):
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
                    os.close(fd)
                    out.append(str(index))
                    continue
                except OSError:
                    pass
                if enter:
                    try:
                        os.stat(os.path.join(path, "."))      # "." is looked up in it: needs search permission
                        out.append(str(index))
                    except OSError:
                        pass
            os.write(write, " ".join(out).encode())
        finally:
            os._exit(0)
    os.close(write)
    data = b""
    while chunk := os.read(read, 65536):
        data += chunk
    os.close(read)
    os.waitpid(pid, 0)
    return [paths[int(i)] for i in data.split()]


# --------------------------------------------------------------------------------------------------
# What the sandbox runs: the interpreter, the packages
# --------------------------------------------------------------------------------------------------


def _open_to_others(path: pathlib.Path, need: int) -> bool:
    """True when a user who is neither owner nor in the group can reach `path` (x on every folder above it)
    and has the `need` bits (0o1 run, 0o4 read) on it."""
    path = pathlib.Path(path)
    try:
        if path.stat().st_mode & need != need:
            return False
        return all(parent.stat().st_mode & 0o001 for parent in path.parents)
    except OSError:
        return False


def _package() -> pathlib.Path:
    import course_lib

    return pathlib.Path(course_lib.__file__).resolve().parent


def _packages() -> list[pathlib.Path]:
    """The two package folders the sandbox's kernel imports (besides the site folders): course_lib (the learner's
    functions run on it) and this grader (its kernel and channel)."""
    return [_package(), pathlib.Path(__file__).resolve().parent]


def _site_dirs() -> list[pathlib.Path]:
    """The folders the judge's Python imports installed packages from (its site-packages, and any such folder
    on its path)."""
    import site

    found = [pathlib.Path(p) for p in site.getsitepackages()]
    found += [pathlib.Path(p) for p in sys.path if p and ("site-packages" in p or "dist-packages" in p)]
    out = []
    for folder in found:
        if folder.is_dir() and folder not in out:
            out.append(folder)
    return out


def checkout_root() -> pathlib.Path | None:
    """The instructor's checkout course_lib is imported from (its parent, when it holds the repository's files),
    or None for an installed package."""
    return _as_checkout(_package().parent)


def _as_checkout(parent: pathlib.Path) -> pathlib.Path | None:
    if any((parent / marker).exists() for marker in (".git", "pyproject.toml", "notebooks")) and \
            "site-packages" not in parent.parts and "dist-packages" not in parent.parts:
        return parent
    return None


def checkouts() -> list[pathlib.Path]:
    """Every checkout of the course this Python knows: the one course_lib is imported from, and those an
    editable install in its site folders points to (a sandbox that reads the site folders learns their paths)."""
    found = [c for c in [checkout_root()] if c is not None]
    for site in _site_dirs():
        for path in list(site.glob("__editable__*course_lib*")) + list(site.glob("course_lib*.egg-link")) + \
                list(site.glob("*.pth")):
            try:
                text = path.read_text(errors="replace")[:100_000]
            except OSError:
                continue
            targets = re.findall(r"""['"]course_lib['"]\s*:\s*['"]([^'"]+)['"]""", text)
            targets += [line.strip() for line in text.splitlines() if line.strip().startswith("/")]
            for target in targets:
                target = pathlib.Path(target)
                for candidate in (target.parent, target) if target.name == "course_lib" else (target,):
                    checkout = _as_checkout(candidate) if (candidate / "course_lib").is_dir() else None
                    if checkout is not None and checkout not in found:
                        found.append(checkout)
    return found


# What a checkout holds that no submission may read: the solved notebooks, the tests (planted bugs and their
# fixes, the rubric's cases), and git's copy of every one of them (.git). Without namespaces the rule is stronger:
# the sandbox user must not enter the checkout at all (`private_parts`).
SECRET_FOLDERS = ("notebooks", "tests", ".git")


def git_dirs(checkout) -> list[pathlib.Path]:
    """The git folders a checkout's history lies in: its .git (or, for a worktree or a submodule, the folder its
    .git file names, and that folder's common one)."""
    dot = pathlib.Path(checkout) / ".git"
    found = []
    if dot.is_dir() and not dot.is_symlink():
        found.append(dot)
    elif dot.is_file() or dot.is_symlink():
        try:
            text = dot.read_text(errors="replace")[:4096] if dot.is_file() else ""
            target = dot.resolve() if dot.is_symlink() else None
        except OSError:
            text, target = "", None
        if text.startswith("gitdir:"):
            target = pathlib.Path(text[len("gitdir:"):].strip().splitlines()[0])
            target = target if target.is_absolute() else (dot.parent / target)
        if target is not None and target.is_dir():
            found.append(target)
    for folder in list(found):
        try:
            common = (folder / "commondir").read_text().strip()
        except OSError:
            continue
        common_dir = pathlib.Path(common) if pathlib.Path(common).is_absolute() else folder / common
        if common_dir.is_dir() and common_dir not in found:
            found.append(common_dir)
    return found


def private_parts(checkout) -> tuple[list[pathlib.Path], list[pathlib.Path]]:
    """What must stay closed to the sandbox user in a checkout of the course (or a bare clone): (folders it must
    not even enter, files it must not open).

    The folder itself comes first: once the sandbox user can enter it, the solved notebooks are a name away
    (the editable install's finder in site-packages names the checkout, and `git show HEAD:notebooks/...` reads
    them from .git's objects, whatever notebooks/ and tests/ allow). Then its git folders, notebooks/ and tests/,
    and the files git reads (HEAD, config, index, packed-refs, the packs), so that a folder opened by an ACL or a
    bind mount is caught too.
    """
    checkout = pathlib.Path(checkout)
    enter = [checkout]
    gits = git_dirs(checkout) if (checkout / ".git").exists() or (checkout / ".git").is_symlink() else []
    if not gits and (checkout / "HEAD").is_file() and (checkout / "objects").is_dir():
        gits = [checkout]                          # a bare clone
    enter += [g for g in gits if g != checkout]
    enter += [checkout / name for name in ("notebooks", "tests") if (checkout / name).is_dir()]
    files = []
    for git in gits:
        files += [git / name for name in ("HEAD", "config", "index", "packed-refs") if (git / name).is_file()]
        enter += [git / "objects"] if (git / "objects").is_dir() else []
        try:
            files += sorted((git / "objects" / "pack").glob("*.pack"))[:50]
        except OSError:
            pass
    return enter, files


def namespace_binds() -> list[str]:
    """The host paths a namespaced sandbox sees (read-only, at their own paths): the system's folders, Python,
    the site folders and course_lib's package folder. Nothing of a checkout but course_lib itself."""
    import torch

    paths = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache", "/etc/ld.so.conf",
             "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives", "/etc/fonts", "/sys/devices/system/cpu"]
    paths += [sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix]
    paths += [str(p) for p in _site_dirs()]
    paths += [str(p) for p in _packages()] + [str(pathlib.Path(torch.__file__).resolve().parent)]
    executable = pathlib.Path(sys.executable)
    paths += [str(executable.parent), str(executable.resolve().parent.parent)]
    chosen = []
    for path in sorted({os.path.abspath(p) for p in paths if p and os.path.lexists(p)}, key=lambda p: (len(p), p)):
        if path == "/" or any(path == c or path.startswith(c.rstrip("/") + "/") for c in chosen):
            continue
        chosen.append(path)
    return chosen


def _python_environment(isolation: str, user: SandboxUser | None) -> tuple[str, dict]:
    """The interpreter the sandbox runs and the environment it adds."""
    if isolation == "namespaces":
        parents = list(dict.fromkeys(str(package.parent) for package in _packages()))
        return sys.executable, {"PYTHONPATH": os.pathsep.join(parents + [str(p) for p in _site_dirs()])}
    if isolation == "users":
        return sandbox_python(user)
    return os.environ.get("COURSE_LIB_SANDBOX_PYTHON") or sys.executable, {}


def sandbox_python(user: SandboxUser | None) -> tuple[str, dict]:
    """For isolation 'users': the interpreter the sandbox user can run, and the PYTHONPATH that finds course_lib
    (always through a root-owned mirror of the package alone, never the checkout around it) and torch.

    A Python installed in root's home (pyenv in /root, common in containers) cannot be run by another user.
    Then a system Python of the same version (/usr/bin/python3.X, same ABI) runs the kernel, finding the packages
    where this one does. COURSE_LIB_SANDBOX_PYTHON names one explicitly.

    Raises:
        SandboxStartError: no interpreter the sandbox user can run, or course_lib / torch it cannot read.
    """
    import torch

    here = pathlib.Path(sys.executable)
    chosen = os.environ.get("COURSE_LIB_SANDBOX_PYTHON")
    if user is None:
        return chosen or sys.executable, {}
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    candidates = [chosen] if chosen else [str(here), f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"]
    # Run by the name it is given: the folders above that name (a venv's bin/ inside a checkout closed to other
    # users) must be open too, not only those above the interpreter it points to.
    python = next((c for c in candidates if c and _open_to_others(pathlib.Path(c).resolve(), 0o001)
                   and _open_to_others(pathlib.Path(os.path.abspath(c)), 0o001)), None)
    if python is None:
        raise SandboxStartError(
            f"the sandbox user {user.name} cannot run {here} (a folder above it is closed to other users, e.g. /root), "
            f"and there is no /usr/bin/python{version}: install Python {version} where every user can run it, or name "
            "one with COURSE_LIB_SANDBOX_PYTHON")
    torch_dir = pathlib.Path(torch.__file__).resolve().parent
    sites = _site_dirs()
    if not _open_to_others(torch_dir, 0o005):
        sites = _mirror_sites(sites)
        torch_dir = next((site / torch_dir.relative_to(folder) for folder, site in zip(_site_dirs(), sites)
                          if torch_dir.is_relative_to(folder)), torch_dir)
    mirror = _mirror_packages()
    for needed in [mirror / package.name for package in _packages()] + [torch_dir]:
        if not _open_to_others(needed, 0o005):
            raise SandboxStartError(f"the sandbox user {user.name} cannot read {needed}: install the course's "
                                    "packages where every user can read them (e.g. a virtual environment in /opt)")
    return python, {"PYTHONPATH": os.pathsep.join([str(mirror)] + [str(p) for p in sites])}


_MIRROR: dict = {}
_MIRROR_LOCK = threading.Lock()       # notebooks start their sandboxes from several threads at once


def _mirror_root() -> pathlib.Path:
    import atexit
    import tempfile

    if "root" not in _MIRROR:
        root = pathlib.Path(tempfile.mkdtemp(prefix="course_lib-sandbox-install-"))
        atexit.register(shutil.rmtree, root, True)
        root.chmod(0o755)
        _MIRROR["root"] = root
    return _MIRROR["root"]


def _link_or_copy(source, target):
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _mirror_packages() -> pathlib.Path:
    """course_lib and this grader alone, as hard links (or copies across file systems) in one root-owned folder every
    user can read, which is returned. The sandbox's PYTHONPATH then holds no folder of the checkout (its notebooks,
    its tests)."""
    with _MIRROR_LOCK:
        return _mirror_packages_locked(_packages())


def _mirror_packages_locked(packages) -> pathlib.Path:
    if "packages" not in _MIRROR:
        for package in packages:
            try:
                shutil.copytree(package, _mirror_root() / "src" / package.name, symlinks=True, copy_function=_link_or_copy,
                                ignore=shutil.ignore_patterns("__pycache__", "pyproject.toml"))
            except OSError as exc:
                raise SandboxStartError(f"could not make a copy of {package.name} the sandbox user may read ({exc})") \
                    from None
        (_mirror_root() / "src").chmod(0o755)
        _MIRROR["packages"] = _mirror_root() / "src"
    return _MIRROR["packages"]


def _mirror_sites(sites) -> list[pathlib.Path]:
    """A read-only view of the site-packages folders for the sandbox user, made once per grader: hard links (no
    bytes copied: about a second for a 1.5 GB environment). The files keep their owner and mode, so the sandbox
    user can read them and write none.

    Raises:
        SandboxStartError: the links cannot be made (the install is on another file system than /tmp).
    """
    with _MIRROR_LOCK:
        return _mirror_sites_locked(sites)


def _mirror_sites_locked(sites) -> list[pathlib.Path]:
    if "sites" not in _MIRROR:
        root = _mirror_root()
        # Each copy keeps the name site-packages: a grader run on the mirror (as that user, e.g. nobody) finds it
        # among its site folders (`_site_dirs`) and hands it on to its own sandboxes.
        mirrored = [root / f"site{index}" / "site-packages" for index in range(len(sites))]
        try:
            for folder, copy in zip(sites, mirrored):
                copy.parent.mkdir()
                copy.parent.chmod(0o755)          # whatever the grader's umask
                shutil.copytree(folder, copy, symlinks=True, copy_function=os.link)
        except OSError as exc:
            raise SandboxStartError(f"the sandbox user cannot read {sites[0]} (a folder above it is closed to other "
                                    f"users), and a mirror of hard links failed ({exc}): install the course's packages "
                                    "where every user can read them (e.g. a virtual environment in /opt)") from None
        _MIRROR["sites"] = mirrored
    return _MIRROR["sites"]


def mirror_folders() -> list[pathlib.Path]:
    """The mirror's folder, if one was made (a sweep need not look inside it)."""
    return [_MIRROR["root"]] if "root" in _MIRROR else []


# --------------------------------------------------------------------------------------------------
# One sandbox
# --------------------------------------------------------------------------------------------------


def _readable(fds, timeout):
    ready, _, _ = select.select(fds, [], [], max(0.0, timeout))
    return ready


_KEEP_ENV = ("PATH", "LANG", "LC_ALL", "TZ")
_NPROC_FACTOR = 4


class Sandbox:
    """One kernel below one warden; see the module docstring. Use `Sandbox.start`."""

    def __init__(self, warden, to_kernel, from_kernel, log_path, limits):
        self._warden, self.kernel_pid = warden, None
        self._to, self._from, self._log = to_kernel, from_kernel, log_path
        self.limits = limits
        self.killed = 0
        self.limit_hit: str | None = None      # "memory 4 GiB", "disk 1 GiB", "processes 1024": what ended it
        self.exit_status: int | None = None    # the kernel's wait status, once the warden saw it end
        self.held: dict = {}                   # how each limit is held (cgroup, tmpfs, rlimit and polling)
        self._stopped = False
        self._lines: list = []
        self._partial = b""
        self._eof = False

    @classmethod
    def start(cls, workdir, log_path, user: SandboxUser | None = None, *, isolation: str = "none",
              limits: Limits | None = None, notebook: dict | None = None,
              startup_timeout: float = 120.0) -> "Sandbox":
        """Start a warden and, below it, the kernel; wait until it is ready.

        Args:
            workdir: with 'namespaces', a folder of root's alone where the sandbox's mount points are made (the
                notebook's copy may lie there); else the sandbox's own folder (its home), owned by `user`.
            log_path: where the kernel's own output goes (a file of root's alone).
            user: the unprivileged user it runs as (root only).
            notebook: {'source': the copy's path, 'name': its file name}: put in the sandbox's home.

        Raises:
            SandboxStartError: it did not start (the message has the end of its log).
        """
        import json

        limits = limits or Limits()
        python, environment = _python_environment(isolation, user)
        to_read, to_write = os.pipe()        # judge -> kernel
        from_read, from_write = os.pipe()    # kernel -> judge
        namespaces = isolation == "namespaces"
        home = HOME if namespaces else str(workdir)
        env = {key: value for key, value in os.environ.items()
               if key in _KEEP_ENV or key.startswith("COURSE_LIB_SANDBOX_")}
        if isolation == "none" and "PYTHONPATH" in os.environ:
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        env.update(environment)
        env.update(HOME=home, TMPDIR="/tmp" if namespaces else os.path.join(home, "tmp"), MPLBACKEND="Agg",
                   MPLCONFIGDIR=os.path.join(home, ".mpl"), IPYTHONDIR=os.path.join(home, ".ipython"),
                   PYTHONDONTWRITEBYTECODE="1", USER="sandbox", LOGNAME="sandbox")
        config = {"isolation": isolation, "command": [python, "-m", "course_grader.kernel", "--in", str(to_read),
                                                      "--out", str(from_write)],
                  "keep_fds": [to_read, from_write], "env": env, "cwd": home, "log": str(log_path),
                  "memory": limits.memory, "disk": limits.disk, "processes": limits.processes,
                  "files": limits.files,
                  "uid": user.uid if user else None, "gid": user.gid if user else None,
                  "user_name": user.name if user else None, "cgroups": running_as_root() and namespaces}
        if namespaces:
            config.update(stage=str(workdir), binds=namespace_binds(), notebook=notebook,
                          userns=not running_as_root())
            # The user's process rlimit counts all its processes: a backstop well above the sandbox's own limit,
            # which the cgroup (or the warden's count) holds per sandbox.
            if running_as_root():
                config.update(nproc=_NPROC_FACTOR * limits.processes)
            else:
                config.update(uid=os.getuid(), gid=os.getgid(),
                              nproc=_user_processes() + _NPROC_FACTOR * limits.processes)
        elif isolation == "users":
            config.update(shared_dirs=writable_dirs(), skip_dirs=[str(p) for p in mirror_folders()],
                          nproc=_NPROC_FACTOR * limits.processes)
        if config["cgroups"]:      # what a grader killed before it finished left: no cgroup outlives its warden
            _warden_module().remove_orphaned_cgroups()
        try:
            warden = subprocess.Popen([sys.executable, WARDEN], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, pass_fds=(to_read, from_write))
        finally:
            os.close(to_read)
            os.close(from_write)
        box = cls(warden, to_write, from_read, log_path, limits)
        try:
            warden.stdin.write(json.dumps(config).encode() + b"\n")
            warden.stdin.flush()
            line = box._next_line(60)
            if not line.startswith("started "):
                reason = line[len("failed "):] if line.startswith("failed ") else (line or "no answer")
                said = (warden.stderr.read1(2000).decode(errors="replace")[-500:]
                        if _readable([warden.stderr], 0.5) else "")
                raise SandboxError(f"the warden could not start the kernel: {reason} {said}".strip())
            started = json.loads(line[len("started "):])
            box.kernel_pid, box.held = int(started["pid"]), started.get("limits", {})
            hello = box._receive(startup_timeout)
            if hello != {"ready": True}:
                raise SandboxError(f"the kernel did not say it was ready: {hello!r}"[:300])
        except (SandboxError, channel.ChannelError, OSError, ValueError, KeyError) as exc:
            box.stop()
            raise SandboxStartError(f"could not start the sandbox: {exc}. Its log ends: {box.log_tail()}") from None
        return box

    def log_tail(self, chars: int = 800) -> str:
        try:
            text = pathlib.Path(self._log).read_bytes()[-chars:].decode(errors="replace")
        except OSError:
            return ""
        return text.strip()

    # -- the warden's lines --------------------------------------------------------------------------

    def _pump(self, timeout: float) -> None:
        """Read what the warden has said (waiting up to `timeout` for something) into lines."""
        if self._eof:
            return
        if not _readable([self._warden.stdout], timeout):
            return
        chunk = os.read(self._warden.stdout.fileno(), 4096)
        if not chunk:
            self._eof = True
        self._partial += chunk
        *lines, self._partial = self._partial.split(b"\n")
        for line in lines:
            text = line.decode(errors="replace").strip()
            if text.startswith("limit ") and self.limit_hit is None:
                self.limit_hit = text[len("limit "):]
            if text.startswith("ended ") and text[6:].lstrip("-").isdigit():
                self.exit_status = int(text[6:])
            self._lines.append(text)

    def _next_line(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while not self._lines and not self._eof and time.monotonic() < deadline:
            self._pump(deadline - time.monotonic())
        return self._lines.pop(0) if self._lines else ""

    def _receive(self, timeout):
        """The kernel's next frame; SandboxDied when the warden reports the kernel gone (or a limit) first."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SandboxTimeout(f"no answer within {timeout:g} s")
            ready = _readable([self._from, self._warden.stdout], min(left, 1.0))
            if self._from in ready:
                try:
                    return channel.receive(self._from, timeout=max(1.0, deadline - time.monotonic()))
                except channel.ChannelClosed:
                    self._await_verdict()
                    raise SandboxDied(self.why_ended()) from None
                except channel.ChannelTimeout:
                    raise SandboxTimeout(f"no complete answer within {timeout:g} s") from None
            elif ready:
                self._pump(0)
                self._lines = [line for line in self._lines if line != "ok"]
                if self.limit_hit or self._eof or self._cleaned():
                    raise SandboxDied(self.why_ended())

    def check_limits(self, timeout: float = 10.0) -> str | None:
        """Ask the warden whether the sandbox has reached a limit by now (after a cell or a check returned). On a
        hit the warden has stopped the sandbox: returns what was reached ('memory 4 GiB'), else None."""
        if self._stopped or self.limit_hit:
            return self.limit_hit
        try:
            self._warden.stdin.write(b"check\n")
            self._warden.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            return self.limit_hit
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._eof:
            while self._lines:
                line = self._lines.pop(0)
                if line == "ok":
                    return None
                if line.startswith("limit ") or line.startswith("clean"):
                    if line.startswith("clean"):
                        self._lines.insert(0, line)
                    return self.limit_hit
            self._pump(deadline - time.monotonic())
        return self.limit_hit

    def _cleaned(self) -> bool:
        """Has the warden said "clean" (everything below it is gone)?"""
        return any(line.startswith("clean") for line in self._lines)

    def _await_verdict(self, timeout: float = 10.0) -> None:
        """The kernel's end of the channel closed: wait for the warden to say why (a limit, the kernel's wait
        status, or its clean-up), so that a cell the OOM killer ended is reported as the memory limit even when a
        busy machine lets the warden notice it a second or two after the judge did."""
        deadline = time.monotonic() + timeout
        while (not self.limit_hit and self.exit_status is None and not self._eof and not self._cleaned()
               and time.monotonic() < deadline):
            self._pump(deadline - time.monotonic())

    def why_ended(self) -> str:
        if self.limit_hit:
            return f"it reached the sandbox's {limit_words(self.limit_hit)} and was stopped"
        if self.exit_status is not None and os.WIFSIGNALED(self.exit_status):
            number = os.WTERMSIG(self.exit_status)
            if number == signal.SIGKILL:
                return ("the kernel was killed (SIGKILL: the machine ran out of memory and the sandbox, first in line, "
                        "was killed, or a process of the notebook killed it)")
            return f"the kernel was killed by signal {number} ({signal.Signals(number).name})"
        return "the kernel ended"

    def request(self, message: dict, timeout: float):
        """Send `message` to the kernel and return its reply (data, not yet trusted).

        Raises:
            SandboxDied: the kernel ended (or reached a limit) before replying.
            SandboxTimeout: no reply within `timeout` seconds (the kernel is left as it is: interrupt or stop it).
            SandboxError: the reply broke the protocol.
        """
        try:
            channel.send(self._to, message)
        except (BrokenPipeError, OSError):
            self._await_verdict()
            raise SandboxDied(self.why_ended()) from None
        try:
            return self._receive(timeout)
        except channel.ChannelError as exc:
            raise SandboxError(str(exc)) from None

    def await_reply(self, timeout: float):
        """The reply to the request already sent (after an interrupt)."""
        try:
            return self._receive(timeout)
        except channel.ChannelError as exc:
            raise SandboxError(str(exc)) from None

    def interrupt(self) -> None:
        """SIGINT to the kernel: the running cell gets a KeyboardInterrupt, as in Jupyter."""
        if self.kernel_pid and not self._stopped:
            try:
                os.kill(self.kernel_pid, signal.SIGINT)
            except OSError:
                pass

    def stop(self) -> int:
        """End the kernel and everything it started; returns how many processes had to be killed (or -1 when
        the warden did not report)."""
        if self._stopped:
            return self.killed
        self._stopped = True
        for fd in (self._to, self._from):
            try:
                os.close(fd)
            except OSError:
                pass
        warden = self._warden
        try:
            warden.stdin.write(b"stop")
            warden.stdin.close()
        except (BrokenPipeError, OSError, ValueError):
            pass
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not self._eof and not self._cleaned():
            self._pump(deadline - time.monotonic())
        self._lines = [line for line in self._lines if line != "ok" and not line.startswith("ended ")]
        try:
            warden.wait(timeout=30)
        except subprocess.TimeoutExpired:
            warden.kill()
            warden.wait()
        if running_as_root():      # a warden killed before it removed its cgroups: remove them here
            _warden_module().remove_orphaned_cgroups(warden.pid)
        for stream in (warden.stdout, warden.stderr):
            stream.close()
        clean = next((l for l in self._lines if l.startswith("clean")), "")
        words = clean.split()
        self.killed = int(words[1]) if len(words) > 1 and words[1].isdigit() else -1
        return self.killed


def limit_words(hit: str) -> str:
    """'memory 4 GiB' -> 'memory limit (4 GiB)'; 'processes 1024' -> 'limit of 1024 processes and threads';
    'files 50000' -> 'limit of 50,000 files'."""
    kind, _, value = hit.partition(" ")
    if kind == "processes":
        return f"limit of {value} processes and threads"
    if kind == "files":
        return f"limit of {int(value):,} files" if value.isdigit() else "limit on files"
    return f"{kind} limit ({value})" if value else f"{kind} limit"


def _user_processes() -> int:
    """How many processes and threads this user runs now (an rlimit on processes counts them all)."""
    uid, count = os.getuid(), 0
    for status in pathlib.Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        uids = next((l.split()[1] for l in text.splitlines() if l.startswith("Uid:")), None)
        if uids == str(uid):
            count += int(next((l.split()[1] for l in text.splitlines() if l.startswith("Threads:")), "1"))
    return count
