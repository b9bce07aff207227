"""Sandboxes: a process of its own for every notebook being graded, as another user when the judge is root.

    box = Sandbox.start(workdir, log_path, user=None)     # the warden, then the kernel in a session of its own
    box.request({"op": "cell", "source": "x = 1"}, timeout=300)     # -> the kernel's reply, as data
    box.interrupt()                                       # SIGINT to the kernel (a cell ran too long)
    box.stop()                                            # -> how many processes had to be killed

Who runs what (docs/architecture.md has the picture):

    judge (python -m course_lib.grade)       never runs the submission's code; computes every score
      warden (_warden.py, one per notebook)  a child subreaper: every process the submission starts stays below it
        kernel (kernel.py)                   the submission's cells, as the sandbox user, in a new session
          ranks (forked by course_lib.launch)  the learner's functions

When the judge is root (Gradescope, a container) the kernel runs as an unprivileged user (`sandbox_users`: one
per student graded at the same time, made with useradd when missing), so it cannot read the judge's files,
write the results, or signal or trace the judge; when the student's last notebook is done, `sweep_user`
kills whatever that user still runs. Without root the kernel runs as the judge's own user: the score still
cannot be forged (it is computed in the judge from data), but such a submission can read and write whatever
you can; grade as root in a container to rule that out.
"""

from __future__ import annotations

import os
import pathlib
import pwd
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from course_lib.grade import channel

__all__ = ["Sandbox", "SandboxUser", "SandboxError", "SandboxStartError", "SandboxDied", "SandboxTimeout", "sandbox_users",
           "release_users", "sweep_user",
           "running_as_root", "WARDEN"]

WARDEN = str(pathlib.Path(__file__).with_name("_warden.py"))
DEFAULT_USER = "course_lib_grader"
NPROC_LIMIT = 4096     # processes and threads of one sandbox user: a fork bomb stops here


class SandboxError(RuntimeError):
    """A sandbox could not be started, or broke the protocol."""


class SandboxStartError(SandboxError):
    """The sandbox could not be started at all: the grader's installation, not the submission, is at fault."""


class SandboxDied(SandboxError):
    """The kernel ended (a cell or an answer killed it) before it replied."""


class SandboxTimeout(SandboxError):
    """The kernel did not reply in time."""


@dataclass(frozen=True)
class SandboxUser:
    name: str
    uid: int
    gid: int


def running_as_root() -> bool:
    return os.geteuid() == 0


_LOCKS = pathlib.Path("/tmp/course_lib-sandbox-users")


def _lock(name: str):
    """Hold user `name` for this grader (an flock, released when the process ends), or None when another grader
    holds it: two graders at once must not share a user, or each would kill the other's sandboxes."""
    import fcntl

    _LOCKS.mkdir(mode=0o700, exist_ok=True)
    info = _LOCKS.stat()
    if info.st_uid != 0 or info.st_mode & 0o077:
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
        sweep_user(user)                 # whatever an earlier grader that crashed left running as this user
        users.append(user)
    return users


_HELD: dict = {}


def release_users(users) -> None:
    """Let other graders use these sandbox users again (after `sweep_user` stopped what they ran)."""
    for user in users:
        handle = _HELD.pop(user.name, None)
        if handle is not None:
            handle.close()


def sweep_user(user: SandboxUser) -> int:
    """Kill every process `user` still runs (as root), wherever it went; returns how many there were."""
    done = subprocess.run([sys.executable, WARDEN, "--sweep-uid", str(user.uid)], capture_output=True, text=True,
                          timeout=60)
    try:
        return int(done.stdout.split()[-1])
    except (IndexError, ValueError):
        raise SandboxError(f"could not stop the processes of {user.name}: {done.stderr.strip()[-300:]}") from None


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


def sandbox_python(user: SandboxUser | None) -> tuple[str, dict]:
    """The interpreter the sandbox runs, and the environment it needs: this one, unless `user` cannot run it.

    A Python installed in root's home (pyenv in /root, common in containers) cannot be run by another user.
    Then a system Python of the same version (/usr/bin/python3.X, same ABI) runs the kernel, finding torch and
    course_lib where this one does (PYTHONPATH). COURSE_LIB_SANDBOX_PYTHON names one explicitly.

    Raises:
        SandboxStartError: no interpreter the sandbox user can run, or course_lib / torch it cannot read.
    """
    import site

    import course_lib

    here = pathlib.Path(sys.executable)
    chosen = os.environ.get("COURSE_LIB_SANDBOX_PYTHON")
    if user is None:
        return chosen or sys.executable, {}
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    candidates = [chosen] if chosen else [str(here), f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"]
    python = next((c for c in candidates if c and _open_to_others(pathlib.Path(c).resolve(), 0o001)), None)
    if python is None:
        raise SandboxStartError(
            f"the sandbox user {user.name} cannot run {here} (a folder above it is closed to other users, e.g. /root), "
            f"and there is no /usr/bin/python{version}: install Python {version} where every user can run it, or name "
            "one with COURSE_LIB_SANDBOX_PYTHON")
    package = pathlib.Path(course_lib.__file__).resolve().parent
    import torch

    torch_dir = pathlib.Path(torch.__file__).resolve().parent
    sites = [pathlib.Path(p) for p in site.getsitepackages() if pathlib.Path(p).is_dir()]
    if not all(_open_to_others(needed, 0o005) for needed in (package, torch_dir)):
        # A folder above the install is closed to other users (a clone in a mktemp folder, a venv in /root):
        # the kernel reads a mirror of it instead, made of hard links in a folder every user can reach.
        package, torch_dir, sites = _mirror_install(package, torch_dir, sites)
        for needed in (package, torch_dir):
            if not _open_to_others(needed, 0o005):
                raise SandboxStartError(f"the sandbox user {user.name} cannot read {needed}: install the course's "
                                        "packages where every user can read them (e.g. a virtual environment in /opt)")
    elif python == str(here):
        return python, {}
    paths = [str(package.parent)] + [str(p) for p in sites]
    return python, {"PYTHONPATH": os.pathsep.join(paths)}


_MIRROR: dict = {}


def _mirror_install(package: pathlib.Path, torch_dir: pathlib.Path, sites: list) -> tuple:
    """A read-only view of course_lib and the site-packages folders for the sandbox user, made once per grader.

    Hard links (no bytes copied: about a second for a 1.5 GB environment) in a root-owned folder under the
    system's temporary folder, removed when the grader exits. The files keep their owner and mode, so the
    sandbox user can read them and write none. Returns the mirrored package, torch folder and site folders.

    Raises:
        SandboxStartError: the links cannot be made (the install is on another file system than /tmp).
    """
    import atexit
    import tempfile

    if "root" not in _MIRROR:
        root = pathlib.Path(tempfile.mkdtemp(prefix="course_lib-sandbox-install-"))
        atexit.register(shutil.rmtree, root, True)
        try:
            shutil.copytree(package, root / "src" / package.name, symlinks=True, copy_function=os.link)
            for index, folder in enumerate(sites):
                shutil.copytree(folder, root / f"site{index}", symlinks=True, copy_function=os.link)
        except OSError as exc:
            shutil.rmtree(root, ignore_errors=True)
            raise SandboxStartError(f"the sandbox user cannot read {package} or {torch_dir} (a folder above them is "
                                    f"closed to other users), and a mirror of hard links failed ({exc}): install the "
                                    "course's packages where every user can read them (e.g. a virtual environment "
                                    "in /opt)") from None
        for folder in (root, root / "src"):
            folder.chmod(0o755)
        _MIRROR["root"] = root
    root = _MIRROR["root"]
    mirrored_sites = [root / f"site{index}" for index in range(len(sites))]
    mirrored_torch = next((site / torch_dir.relative_to(folder) for folder, site in zip(sites, mirrored_sites)
                           if torch_dir.is_relative_to(folder)), torch_dir)
    return root / "src" / package.name, mirrored_torch, mirrored_sites


def _readable(fds, timeout):
    ready, _, _ = select.select(fds, [], [], max(0.0, timeout))
    return ready


def _read_line(stream, timeout: float) -> str:
    """One line from the warden, read byte by byte (no buffer that select could not see)."""
    line, deadline = b"", time.monotonic() + timeout
    while not line.endswith(b"\n"):
        if not _readable([stream], deadline - time.monotonic()):
            break
        byte = os.read(stream.fileno(), 1)
        if not byte:
            break
        line += byte
    return line.decode(errors="replace")


class Sandbox:
    """One kernel below one warden; see the module docstring. Use `Sandbox.start`."""

    def __init__(self, warden, kernel_pid, to_kernel, from_kernel, log_path):
        self._warden, self.kernel_pid = warden, kernel_pid
        self._to, self._from, self._log = to_kernel, from_kernel, log_path
        self.killed = 0
        self._stopped = False

    @classmethod
    def start(cls, workdir, log_path, user: SandboxUser | None = None, startup_timeout: float = 120.0) -> "Sandbox":
        """Start a warden and, below it, the kernel in `workdir` (as `user` when given); wait until it is ready.

        Raises:
            SandboxStartError: it did not start (the message has the end of its log).
        """
        python, environment = sandbox_python(user)
        to_read, to_write = os.pipe()        # judge -> kernel
        from_read, from_write = os.pipe()    # kernel -> judge
        command = [sys.executable, WARDEN, "--cwd", str(workdir), "--log", str(log_path),
                   "--keep-fds", f"{to_read},{from_write}"]
        if user is not None:
            command += ["--uid", str(user.uid), "--gid", str(user.gid), "--nproc", str(NPROC_LIMIT)]
        command += ["--", python, "-m", "course_lib.grade.kernel", "--in", str(to_read), "--out", str(from_write)]
        try:
            warden = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      pass_fds=(to_read, from_write), env={**os.environ, **environment})
        finally:
            os.close(to_read)
            os.close(from_write)
        box = cls(warden, None, to_write, from_read, log_path)
        try:
            line = _read_line(warden.stdout, 30).split()
            if line[:1] != ["started"]:
                raise SandboxError("the warden could not start the kernel: " + warden.stderr.read().decode()[-500:])
            box.kernel_pid = int(line[1])
            hello = box._receive(startup_timeout)
            if hello != {"ready": True}:
                raise SandboxError(f"the kernel did not say it was ready: {hello!r}"[:300])
        except (SandboxError, channel.ChannelError, OSError, ValueError) as exc:
            box.stop()
            raise SandboxStartError(f"could not start the sandbox: {exc}. Its log ends: {box.log_tail()}") from None
        return box

    def log_tail(self, chars: int = 800) -> str:
        try:
            text = pathlib.Path(self._log).read_bytes()[-chars:].decode(errors="replace")
        except OSError:
            return ""
        return text.strip()

    def _receive(self, timeout):
        """The kernel's next frame; SandboxDied when the warden reports the kernel gone first."""
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
                    raise SandboxDied("the kernel ended") from None
                except channel.ChannelTimeout:
                    raise SandboxTimeout(f"no complete answer within {timeout:g} s") from None
            elif ready:
                raise SandboxDied("the kernel ended")

    def request(self, message: dict, timeout: float):
        """Send `message` to the kernel and return its reply (data, not yet trusted).

        Raises:
            SandboxDied: the kernel ended before replying.
            SandboxTimeout: no reply within `timeout` seconds (the kernel is left as it is: interrupt or stop it).
            SandboxError: the reply broke the protocol.
        """
        try:
            channel.send(self._to, message)
        except (BrokenPipeError, OSError):
            raise SandboxDied("the kernel ended") from None
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
        report = b""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and b"clean" not in report:
            if _readable([warden.stdout], deadline - time.monotonic()):
                chunk = os.read(warden.stdout.fileno(), 256)
                if not chunk:
                    break
                report += chunk
        try:
            warden.wait(timeout=30)
        except subprocess.TimeoutExpired:
            warden.kill()
            warden.wait()
        for stream in (warden.stdout, warden.stderr):
            stream.close()
        words = report.decode(errors="replace").split()
        self.killed = int(words[words.index("clean") + 1]) if "clean" in words else -1
        return self.killed
