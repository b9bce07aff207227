"""The warden: starts one sandboxed process and makes sure nothing it started outlives it.

The judge runs it as a script, not as part of the course_lib package, so that it starts in milliseconds
and imports nothing a submission could have touched:

    python _warden.py [--uid U --gid G] [--nproc N] --cwd DIR --log FILE -- COMMAND...
    python _warden.py --sweep-uid U          # as root: kill every process of user U, until none is left

What it does, in order:

1. It makes itself a *child subreaper* (prctl PR_SET_CHILD_SUBREAPER): a process below it whose parent dies
   (a double fork, a daemon that called setsid) is re-parented to the warden instead of to init, so it can
   still be found. It also makes itself undumpable, so a sandbox running as the same user cannot ptrace it.
2. It starts COMMAND in a new session, with its output going to FILE, as user U (group G, no other groups)
   when those are given, with the sandbox's limits: no core files, files of at most 1 GiB, at most N processes
   for that user, and the first place the out-of-memory killer looks.
3. It prints "started <pid>" and waits until COMMAND ends or its own stdin (a pipe from the judge) closes or
   says "stop".
4. It kills everything below it: COMMAND's session, then every descendant it finds in /proc (re-parented
   orphans included), again and again until none is left, and reaps them all.
5. It prints "clean <n>" (n: the processes it had to kill after COMMAND was asked to stop) and exits.

The judge reads only those two lines from it; everything the sandbox says goes through pipes the judge
gave to COMMAND (kept open with --keep-fds), never through the warden.
"""

import ctypes
import os
import select
import signal
import sys
import time

PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
FILE_LIMIT = 2**30


def _prctl(option, value):
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def _parents():
    """{pid: parent pid} for every process in /proc."""
    parents = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            parents[int(name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    return parents


def _descendants(root):
    parents = _parents()
    children = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _reap():
    """Collect every child that has ended; returns their pids."""
    ended = []
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        ended.append(pid)


def _running(pid):
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def _kill_below(me, first):
    """SIGKILL `first`'s session and every descendant of `me`, until none is left. Returns how many processes
    other than `first` itself were still running: what the sandbox left behind."""
    left = [pid for pid in _descendants(me) if pid != first and _running(pid)]
    try:
        os.killpg(first, signal.SIGKILL)       # the command is its session's and group's leader
    except OSError:
        pass
    for _ in range(1000):
        reaped = set(_reap())
        alive = [pid for pid in _descendants(me) if pid not in reaped]
        if not alive:
            break
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)
    _reap()
    return len(left)


def _uid_processes(uid):
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        if uid in [int(x) for x in line.split()[1:]]:
                            found.append(int(name))
                        break
        except OSError:
            continue
    return found


def sweep_uid(uid):
    """Kill every process of user `uid` (as root): a child becomes that user and sends SIGKILL to all it may
    signal (kill(-1, ...)), again until /proc shows none. Catches anything the user started, wherever it went."""
    killed = 0
    for _ in range(200):
        left = _uid_processes(uid)
        if not left:
            return killed
        killed += len(left)
        pid = os.fork()
        if pid == 0:
            try:
                os.setgroups([])
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        time.sleep(0.02)
    return killed


def _limits(uid, nproc):
    import resource

    def apply():
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))
        if uid is not None and nproc:
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        try:
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")
        except OSError:
            pass
    return apply


def main(argv):
    if argv[:1] == ["--sweep-uid"]:
        print(f"clean {sweep_uid(int(argv[1]))}", flush=True)
        return 0
    split = argv.index("--")
    options, command = argv[:split], argv[split + 1:]
    opts = dict(zip(options[::2], options[1::2]))
    uid = int(opts["--uid"]) if "--uid" in opts else None
    gid = int(opts["--gid"]) if "--gid" in opts else None
    keep = tuple(int(fd) for fd in opts.get("--keep-fds", "").split(",") if fd)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    _prctl(PR_SET_DUMPABLE, 0)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    import subprocess

    with open(opts["--log"], "ab") as log:
        child = subprocess.Popen(command, cwd=opts["--cwd"], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                 pass_fds=keep, start_new_session=True, env=_environment(opts),
                                 user=uid, group=gid, extra_groups=[] if uid is not None else None,
                                 preexec_fn=_limits(uid, int(opts.get("--nproc", 0))))
    for fd in keep:
        os.close(fd)
    print(f"started {child.pid}", flush=True)
    while not stopping:
        ready, _, _ = select.select([sys.stdin], [], [], 0.1)
        if ready:
            data = os.read(sys.stdin.fileno(), 64)
            if not data or b"stop" in data:
                break
        if child.pid in _reap():
            break
    print(f"clean {_kill_below(os.getpid(), child.pid)}", flush=True)
    return 0


def _environment(opts):
    """The sandbox's environment: the judge's, minus anything that is not the sandbox's business."""
    env = {key: value for key, value in os.environ.items()
           if key in ("PATH", "LANG", "LC_ALL", "PYTHONPATH", "VIRTUAL_ENV", "TZ") or key.startswith("COURSE_LIB_SANDBOX_")}
    home = opts["--cwd"]
    env.update(HOME=home, TMPDIR=os.path.join(home, "tmp"), MPLBACKEND="Agg", MPLCONFIGDIR=os.path.join(home, ".mpl"),
               IPYTHONDIR=os.path.join(home, ".ipython"), PYTHONDONTWRITEBYTECODE="1", USER="sandbox", LOGNAME="sandbox")
    return env


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
