"""The warden: starts one sandboxed process, holds it to its limits, and makes sure nothing it did outlives it.

The judge runs it as a script, not as part of the course_lib package, so that it starts in milliseconds and
imports nothing a submission could have touched. Its command line names no path (a submission could read it
in /proc): what to do comes as one line of JSON on its stdin.

    python _warden.py                      # the sandbox: a JSON line on stdin, then "stop" (or EOF) ends it
    python _warden.py --probe              # can this machine give namespaces? prints "ok" or the reason
    python _warden.py --sweep-uid U        # as root: kill every process of user U, remove its IPC objects and
                                           # (with folders on stdin, one a line) every file it owns below them;
                                           # --files-only: leave its processes be

With isolation "namespaces" (root, or a user allowed unprivileged user namespaces):

1. The warden makes itself a child subreaper and undumpable, puts a cgroup around the sandbox where it may
   (memory, pids, cpu: the limits), and forks the sandbox's init, the first process of a new PID namespace.
2. The init enters new mount, IPC, network and UTS namespaces and builds a root of its own: a read-only
   skeleton holding read-only binds of what Python, torch and course_lib need (nothing else of the host:
   no repository, no other submission, no log), a fresh /proc that shows the sandbox's processes only, and
   one tmpfs of the disk limit's size for /tmp, /var/tmp, /dev/shm and the home folder (the notebook's copy
   in it). Only the loopback interface exists, its own. Then pivot_root, and the old root is detached.
3. The init forks the kernel (a new session, the sandbox user, no new privileges, the limits) and reaps
   whatever ends below it; when the kernel ends, the init ends and the kernel kills everything else in the
   namespace. The namespaces, their tmpfs, SysV objects and sockets go with their last process.

With isolation "users" (root without namespaces, e.g. a container without CAP_SYS_ADMIN) or "none" (no
root), the kernel starts as a child of the warden in a new session (as user U with "users"), with the same
limits as far as rlimits and the warden's polling reach; the judge sweeps the user's files and IPC objects.

In both, the warden prints "started {json}" (the kernel's pid, how each limit is held), watches the limits
(a hit: "limit <kind> <what>", and everything is killed), waits until the kernel ends or its stdin says
"stop", kills everything below it (re-parented orphans included) and prints "clean <n>": how many processes
besides the kernel were still running.
"""

import ctypes
import errno
import glob
import json
import os
import select
import signal
import socket
import stat
import struct
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MNT_DETACH = 2
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217,
              "i686": 217, "armv7l": 218}
IPC_RMID = 0
HOME = "/home/sandbox"
SKELETON_BYTES = 8 << 20
POLL = 0.1                      # seconds between two looks at the limits' counters
LOG_BYTES = 64 << 10            # the end of the kernel's own output kept for the judge's log
SLOW_POLL = 0.5                 # seconds between two sums of the processes' memory (where no cgroup counts it)
INODES_SPARE = 16               # inodes of the sandbox's tmpfs beyond its file limit: its own folders, the copy

_libc = ctypes.CDLL(None, use_errno=True)


def _os_error(what):
    code = ctypes.get_errno()
    return OSError(code, f"{what}: {os.strerror(code)}")


def _prctl(option, value):
    if _libc.prctl(ctypes.c_int(option), ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0),
                   ctypes.c_ulong(0)) != 0:
        raise _os_error(f"prctl({option})")


def _bytes(text):
    return None if text is None else os.fsencode(text)


def _mount(source, target, fstype, flags, data=None):
    if _libc.mount(_bytes(source), _bytes(target), _bytes(fstype), ctypes.c_ulong(flags), _bytes(data)) != 0:
        raise _os_error(f"mount {target}")


def _unshare(flags):
    if _libc.unshare(ctypes.c_int(flags)) != 0:
        raise _os_error("unshare")


def _pivot_root_here():
    """pivot_root(".", "."), then detach the old root stacked below (pivot_root(2)'s own recipe)."""
    number = PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise OSError(errno.ENOSYS, f"pivot_root: unknown machine {os.uname().machine}")
    if _libc.syscall(ctypes.c_long(number), b".", b".") != 0:
        raise _os_error("pivot_root")
    if _libc.umount2(b".", ctypes.c_int(MNT_DETACH)) != 0:
        raise _os_error("umount the old root")


# --------------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------------


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
    children = {}
    for pid, parent in _parents().items():
        children.setdefault(parent, []).append(pid)
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


_REAPED = set()     # every pid this warden has reaped: a pid once reaped may belong to anyone afterwards


def _reap():
    """Collect every child that has ended: {pid: wait status}."""
    ended = {}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        ended[pid] = status
        _REAPED.add(pid)


def _running(pid):
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def _kill_below(me, first, spare=()):
    """SIGKILL `first` (its session too) and every descendant of `me`, until none is left. Returns how many
    processes other than those in `spare` were still running: what the sandbox left behind.

    Once reaped, `first` is not signalled: its pid (and a process group of that number) may be another
    process's by then. What it left below the warden is found as the warden's descendants all the same."""
    left = [pid for pid in _descendants(me) if pid not in spare and pid != first and _running(pid)]
    targets = () if first in _REAPED else (lambda: os.killpg(first, signal.SIGKILL),
                                           lambda: os.kill(first, signal.SIGKILL))
    for target in targets:
        try:
            target()
        except OSError:
            pass
    for _ in range(3000):
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


def _kill_uid(uid):
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


# --------------------------------------------------------------------------------------------------
# What a user leaves behind: System V IPC objects and files
# --------------------------------------------------------------------------------------------------


def ipc_objects(uid=None):
    """[(kind, id, bytes)] of the System V shared memory segments, message queues and semaphore sets that `uid`
    owns or created (every one when uid is None), from /proc/sysvipc."""
    found = []
    for kind, id_column in (("shm", 1), ("msg", 1), ("sem", 1)):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                header = f.readline().split()
                for line in f:
                    fields = dict(zip(header, line.split()))
                    if uid is None or str(uid) in (fields.get("uid"), fields.get("cuid")):
                        found.append((kind, int(fields[header[id_column]]), int(fields.get("size", 0) or 0)))
        except (OSError, ValueError, KeyError):
            continue
    return found


def _remove_ipc(uid):
    removed = 0
    for kind, ident, _ in ipc_objects(uid):
        call = {"shm": lambda: _libc.shmctl(ctypes.c_int(ident), ctypes.c_int(IPC_RMID), None),
                "msg": lambda: _libc.msgctl(ctypes.c_int(ident), ctypes.c_int(IPC_RMID), None),
                "sem": lambda: _libc.semctl(ctypes.c_int(ident), ctypes.c_int(0), ctypes.c_int(IPC_RMID))}[kind]
        if call() == 0:
            removed += 1
    return removed


def _remove_tree(path):
    """Remove `path` (a file, a link or a folder and all below it) without following any link."""
    try:
        info = os.lstat(path)
    except OSError:
        return
    if stat.S_ISDIR(info.st_mode):
        try:
            os.chmod(path, 0o700)
            entries = os.listdir(path)
        except OSError:
            entries = []
        for name in entries:
            _remove_tree(os.path.join(path, name))
        try:
            os.rmdir(path)
        except OSError:
            pass
    else:
        try:
            os.unlink(path)
        except OSError:
            pass


def owned_files(uid, folders, skip=()):
    """Every entry below `folders` that `uid` owns (its top-most one where it owns a folder), found without
    following links, and the bytes they hold.

    A folder of another owner that neither its group nor others may enter (no x for group and other) is not
    looked into: `uid` could never have made an entry below it (that takes search permission on every folder
    on the way; with ACLs too, whose mask is the group bits). On a machine whose /tmp holds closed checkouts
    and virtual environments, that is most of what a full walk would read."""
    found, size = [], 0
    todo = [f for f in folders if f not in skip]
    while todo:
        folder = todo.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            if entry.path in skip:
                continue
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if info.st_uid == uid:
                found.append(entry.path)
                size += _size(entry.path, info)
            elif stat.S_ISDIR(info.st_mode) and info.st_mode & 0o011:
                todo.append(entry.path)
    return found, size


def _size(path, info):
    if not stat.S_ISDIR(info.st_mode):
        return info.st_blocks * 512
    total = 0
    for root, folders, files in os.walk(path):
        for name in files + folders:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def sweep_uid(uid, folders=(), skip=(), processes=True):
    """Kill every process of `uid` (unless `processes` is False), remove its System V IPC objects and every file
    it owns below `folders`. Returns (processes, ipc objects, files) removed."""
    killed = _kill_uid(uid) if processes else 0
    ipc = _remove_ipc(uid)
    files, _ = owned_files(uid, folders, set(skip))
    for path in files:
        _remove_tree(path)
    return killed, ipc, len(files)


# --------------------------------------------------------------------------------------------------
# Limits
# --------------------------------------------------------------------------------------------------


def _cgroup_mounts():
    """{controller: mount point} of the cgroup file systems (v1 per controller, 'unified' for v2)."""
    mounts = {}
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, right = line.split(" - ", 1)
                fstype, _, options = right.split()[:3]
                point = left.split()[4]
                if fstype == "cgroup2":
                    mounts.setdefault("unified", point)
                elif fstype == "cgroup":
                    for option in options.split(","):
                        if option in ("memory", "pids", "cpu"):
                            mounts.setdefault(option, point)
    except OSError:
        pass
    return mounts


def _own_cgroups():
    """{controller: this process's cgroup path} ('unified' for v2)."""
    paths = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "":
                    paths["unified"] = path
                for controller in controllers.split(","):
                    paths[controller] = path
    except OSError:
        pass
    return paths


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _read_counter(path, key):
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


class Cgroups:
    """The sandbox's cgroups where this machine lets us make them: a memory limit (swap included), a process limit,
    and a CPU group of its own (so a sandbox full of busy processes gets its share, not more)."""

    def __init__(self, name, memory, processes):
        self.dirs, self.held = [], {}
        mounts, own = _cgroup_mounts(), _own_cgroups()
        if "unified" in mounts and not any(c in mounts for c in ("memory", "pids", "cpu")):
            self._v2(mounts["unified"], own.get("unified", "/"), name, memory, processes)
            return
        for controller in ("memory", "pids", "cpu"):
            if controller not in mounts:
                continue
            folder = os.path.join(mounts[controller], own.get(controller, "/").lstrip("/"), name)
            try:
                os.mkdir(folder)
            except OSError:
                continue
            self.dirs.append(folder)
            try:
                if controller == "memory":
                    _write(os.path.join(folder, "memory.limit_in_bytes"), str(memory))
                    swap = os.path.join(folder, "memory.memsw.limit_in_bytes")
                    if os.path.exists(swap):
                        _write(swap, str(memory))
                    self.held["memory"] = (os.path.join(folder, "memory.oom_control"), "oom_kill")
                elif controller == "pids":
                    _write(os.path.join(folder, "pids.max"), str(processes))
                    self.held["processes"] = (os.path.join(folder, "pids.events"), "max")
                else:
                    self.held["cpu"] = None
            except OSError:
                continue

    def _v2(self, mount, own, name, memory, processes):
        parent = os.path.join(mount, own.lstrip("/"))
        try:
            _write(os.path.join(parent, "cgroup.subtree_control"), "+memory +pids +cpu")
        except OSError:
            pass          # busy (this cgroup holds processes) or not delegated: the controllers may still be on
        folder = os.path.join(parent, name)
        try:
            os.mkdir(folder)
        except OSError:
            return
        self.dirs.append(folder)
        for file, value, kind, events, key in (("memory.max", memory, "memory", "memory.events", "oom_kill"),
                                               ("pids.max", processes, "processes", "pids.events", "max")):
            try:
                _write(os.path.join(folder, file), str(value))
                self.held[kind] = (os.path.join(folder, events), key)
            except OSError:
                pass
        try:
            _write(os.path.join(folder, "memory.swap.max"), "0")
        except OSError:
            pass
        if os.path.exists(os.path.join(folder, "cpu.weight")):
            self.held["cpu"] = None

    def add(self, pid):
        for folder in self.dirs:
            try:
                _write(os.path.join(folder, "cgroup.procs"), str(pid))
            except OSError:
                pass

    def counts(self):
        return {kind: _read_counter(*where) for kind, where in self.held.items() if where}

    def remove(self):
        for folder in self.dirs:
            remove_cgroup(folder)


CGROUP_PREFIX = "course_lib-sandbox-"      # + the warden's pid: the cgroups of one sandbox


def remove_cgroup(folder, seconds=30.0, reap=True):
    """Kill what is still in the cgroup `folder` and remove it; True once it is gone.

    A killed process stays charged to the cgroup until its parent reaps it, and the warden is the subreaper of
    everything in its sandbox: so the warden reaps while it waits (`reap`), or a busy machine's slow exits would
    keep the folder. Any other caller must not (it would collect its own children's exit statuses)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            os.rmdir(folder)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
        try:
            with open(os.path.join(folder, "cgroup.procs")) as f:
                for pid in f.read().split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (OSError, ValueError):
                        pass
        except OSError:
            pass
        if reap:
            _reap()
        time.sleep(0.02)


def sandbox_cgroups(warden_pid=None):
    """The sandboxes' cgroup folders beside this process's own cgroups (where wardens started by this process, or
    by another with the same cgroups, make them): all of them, or those of one warden."""
    mounts, own = _cgroup_mounts(), _own_cgroups()
    name = CGROUP_PREFIX + (str(warden_pid) if warden_pid is not None else "*")
    found = set()
    for controller, mount in mounts.items():
        parent = os.path.join(mount, own.get(controller, "/").lstrip("/"))
        found.update(glob.glob(os.path.join(glob.escape(parent), name)))
    return sorted(found)


def remove_orphaned_cgroups(warden_pid=None):
    """Remove the cgroups of one warden that has ended (it was killed before it could), or of every warden that no
    longer runs: a grader that was itself killed leaves them behind. Returns the folders it could not remove."""
    left = []
    for folder in sandbox_cgroups(warden_pid):
        pid = os.path.basename(folder)[len(CGROUP_PREFIX):]
        if warden_pid is None and (not pid.isdigit() or _running(int(pid))):
            continue                       # a warden still at work (or not one of ours)
        if not remove_cgroup(folder, seconds=10.0, reap=False):
            left.append(folder)
    return left


def _pss(pid):
    """The process's proportional set size in bytes (shared pages divided among their sharers)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _threads(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _human(count):
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:g} {unit}"
    return f"{count} bytes"


class Watch:
    """Looks at the sandbox's limits every POLL seconds; `hit()` names the first one reached, or None."""

    def __init__(self, config, cgroups, root_pid, disk_path):
        self.config, self.cgroups, self.root_pid, self.disk_path = config, cgroups, root_pid, disk_path
        self.memory, self.disk, self.processes = config["memory"], config["disk"], config["processes"]
        self.start = cgroups.counts() if cgroups else {}
        self.next_slow = 0.0
        self.files = config.get("files") or (1 << 62)
        self.users_files = config.get("shared_dirs") if config["isolation"] == "users" else None
        self.skip = set(config.get("skip_dirs") or ())

    def how(self):
        """How each limit is held, for the judge's records."""
        held = self.cgroups.held if self.cgroups else {}
        return {"memory": "cgroup" if "memory" in held else "rlimit and polling",
                "processes": "cgroup" if "processes" in held else "rlimit and polling",
                "disk": "tmpfs" if self.disk_path else "file size rlimit and polling",
                "files": "tmpfs inodes" if self.disk_path else "polling",
                "cpu": "cgroup" if "cpu" in held else "shared"}

    def hit(self, now=False):
        """The limit reached, if one was (`now`: do the slow sums too, whenever they were last done)."""
        counts = self.cgroups.counts() if self.cgroups else {}
        for kind, value in counts.items():
            if value > self.start.get(kind, 0):
                limit = self.memory if kind == "memory" else self.processes
                return f"{kind} {_human(limit) if kind == 'memory' else limit}"
        if self.disk_path:
            try:
                free = os.statvfs(self.disk_path)
                if free.f_bavail * free.f_frsize < min(1 << 20, self.disk // 100 + 4096):
                    return f"disk {_human(self.disk)}"
                if free.f_files and free.f_ffree <= INODES_SPARE // 2:      # its tmpfs has `files` inodes
                    return f"files {self.files}"
            except OSError:
                pass
        held = self.cgroups.held if self.cgroups else {}
        if "memory" in held and "processes" in held and self.users_files is None:
            return None
        if not now and time.monotonic() < self.next_slow:
            return None
        self.next_slow = time.monotonic() + SLOW_POLL
        below = _descendants(self.root_pid) + [self.root_pid]
        if "memory" not in held:
            used = sum(_pss(pid) for pid in below)
            if self.config["isolation"] == "users":
                used += sum(size for kind, _, size in ipc_objects(self.config["uid"]) if kind == "shm")
            if used > self.memory:
                return f"memory {_human(self.memory)}"
        if "processes" not in held and sum(_threads(pid) for pid in below) >= self.processes - 8:
            return f"processes {self.processes}"
        if self.users_files is not None:
            started = time.monotonic()
            used, files = users_usage(self.config["uid"], self.config["cwd"], self.users_files, self.skip, below,
                                      self.disk, self.files)
            # The walk grows with what the user made (half a second for 50,000 files): the next one waits twice as
            # long as this one took, so that the warden takes at most a third of a core from the sandbox.
            self.next_slow = max(self.next_slow, time.monotonic() + 2 * (time.monotonic() - started))
            if used > self.disk:
                return f"disk {_human(self.disk)}"
            if files > self.files:
                return f"files {self.files}"
        return None


def users_usage(uid, home, folders, skip=(), pids=(), disk=1 << 62, files=1 << 62):
    """(bytes, files and folders) user `uid` holds, counted as without namespaces: all below its own folder
    `home`; every entry it owns at the top of `folders` (every folder any user may write, nested ones included)
    and all below such an entry, whoever owns it; a world-writable folder found there that `folders` did not
    list is looked into too; and the deleted files `pids` still hold open. An empty file counts one file and no
    byte; an inode counts once however many names it has. Stops counting once over `disk` or `files`."""
    seen, used, count = set(), 0, 0
    listed = set(folders)

    def add(info):
        nonlocal used, count
        key = (info.st_dev, info.st_ino)
        if key in seen:
            return
        seen.add(key)
        used += info.st_blocks * 512
        count += 1

    def over():
        return used > disk or count > files

    def everything_below(path):
        todo = [path]
        while todo and not over():
            folder = todo.pop()
            try:
                with os.scandir(folder) as entries:
                    for entry in entries:
                        try:
                            info = entry.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        add(info)
                        if stat.S_ISDIR(info.st_mode) and entry.path not in skip:
                            todo.append(entry.path)
                        if over():
                            return
            except OSError:
                continue

    try:
        add(os.lstat(home))
    except OSError:
        pass
    everything_below(home)
    todo = [f for f in folders if f not in skip]
    while todo and not over():
        folder = todo.pop()
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    if entry.path in skip:
                        continue
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if info.st_uid == uid:
                        add(info)
                        if stat.S_ISDIR(info.st_mode):
                            everything_below(entry.path)
                        if over():
                            break
                    elif stat.S_ISDIR(info.st_mode) and info.st_mode & 0o002 and entry.path not in listed:
                        listed.add(entry.path)          # made world-writable after the grader looked
                        todo.append(entry.path)
        except OSError:
            continue
    for pid in pids:
        if over():
            break
        try:
            descriptors = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in descriptors:
            try:
                info = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode) and info.st_nlink == 0 and info.st_uid == uid:
                add(info)
    return used, count


def _rlimits(config):
    import resource

    limits = [(resource.RLIMIT_CORE, 0), (resource.RLIMIT_FSIZE, config["disk"] + 4096)]
    if config["isolation"] != "namespaces" or not config.get("cgroup_memory"):
        limits.append((resource.RLIMIT_AS, config["memory"] + config.get("address_space_base", 1 << 30)))
    if config.get("nproc"):
        limits.append((resource.RLIMIT_NPROC, config["nproc"]))
    for which, value in limits:
        try:
            soft, hard = resource.getrlimit(which)
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(which, (value, value))
        except (OSError, ValueError):
            pass


def _become_kernel(config, log_fd, keep):
    """In the forked child that becomes the kernel: session, output, limits, user, no new privileges, exec."""
    os.setsid()
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    for fd in _open_fds():
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass
    _rlimits(config)
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
    uid, gid = config.get("uid"), config.get("gid")
    if uid is not None and not config.get("userns"):
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    _seccomp()
    os.chdir(config["cwd"])
    command = config["command"]
    os.execve(command[0], command, config["env"])


# System calls the sandbox is refused (seccomp), per machine: the kernel's key rings, which outlive a process and
# are shared by all processes of a user (a submission could leave a solution there for the next one graded as
# the same user), and making namespaces (much of the kernel's attack surface; the sandbox needs none).
# clone3 is refused with ENOSYS (its flags are behind a pointer a filter cannot read): the C library then uses
# clone, whose namespace flags are refused. {machine: (audit arch, {name: number})}
_SYSCALLS = {
    "x86_64": (0xC000003E, {"add_key": 248, "request_key": 249, "keyctl": 250, "unshare": 272, "setns": 308,
                            "clone": 56, "clone3": 435}),
    "aarch64": (0xC00000B7, {"add_key": 217, "request_key": 218, "keyctl": 219, "unshare": 97, "setns": 268,
                             "clone": 220, "clone3": 435}),
}
_NAMESPACE_FLAGS = (CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
                    | 0x02000000)            # CLONE_NEWCGROUP


def seccomp_program(machine):
    """The classic BPF program of the filter for `machine`, as (code, jt, jf, k) tuples; None where unknown."""
    if machine not in _SYSCALLS:
        return None
    arch, numbers = _SYSCALLS[machine]
    load, jeq, jset, ret = 0x20, 0x15, 0x45, 0x06          # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JSET|K, BPF_RET|K
    allow, refuse, missing = 0x7FFF0000, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
    refused = [numbers[name] for name in ("add_key", "request_key", "keyctl", "unshare", "setns")]
    # Another machine's calls (i386's int 0x80, with other numbers) are refused whole, and so are x32's.
    program = [(load, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, refuse), (load, 0, 0, 0)]
    if machine == "x86_64":
        program += [(jset, 0, 1, 0x40000000), (ret, 0, 0, refuse)]
    for number in refused:
        program += [(jeq, 0, 1, number), (ret, 0, 0, refuse)]
    program += [(jeq, 0, 1, numbers["clone3"]), (ret, 0, 0, missing)]
    program += [(jeq, 1, 0, numbers["clone"]), (ret, 0, 0, allow),
                (load, 0, 0, 16), (jset, 0, 1, _NAMESPACE_FLAGS), (ret, 0, 0, refuse), (ret, 0, 0, allow)]
    return program


def _seccomp():
    """Install the filter above on this process (and all it starts). Needs no privilege once no_new_privs is set."""
    program = seccomp_program(os.uname().machine)
    if program is None:
        return False

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(Filter))]

    filters = (Filter * len(program))(*[Filter(*entry) for entry in program])
    prog = Program(len(program), filters)
    if _libc.prctl(ctypes.c_int(22), ctypes.c_ulong(2), ctypes.byref(prog), ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        raise _os_error("seccomp")                          # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
    return True


def _open_fds():
    try:
        return sorted(int(name) for name in os.listdir("/proc/self/fd"))
    except OSError:
        return list(range(3, 1024))


# --------------------------------------------------------------------------------------------------
# The namespaces: the sandbox's own root
# --------------------------------------------------------------------------------------------------


def _loopback_up():
    """Bring up the network namespace's own loopback interface (the ranks talk over it)."""
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, request)[:18])[1]         # SIOCGIFFLAGS
        fcntl.ioctl(s, 0x8914, struct.pack("16sH14s", b"lo", flags | 1, b""))       # SIOCSIFFLAGS, IFF_UP


def _makedirs(path):
    os.makedirs(path, mode=0o755, exist_ok=True)


def _bind(source, target, writable=False):
    """Bind `source` (a host path, seen before the pivot) at `target`, read-only unless asked, never setuid.
    A link is made again as the same link."""
    if os.path.islink(source):
        _makedirs(os.path.dirname(target))
        if not os.path.lexists(target):
            os.symlink(os.readlink(source), target)
        return
    if os.path.isdir(source):
        _makedirs(target)
    else:
        _makedirs(os.path.dirname(target))
        if not os.path.exists(target):
            open(target, "w").close()
    _mount(source, target, None, MS_BIND)
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | (0 if writable else MS_RDONLY)
    _mount(None, target, None, flags)


def _write_file(path, text, mode=0o644):
    _makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)


def _build_root(config):
    """In the sandbox's init, in its new mount namespace: the new root at config['stage']/root, then pivot."""
    stage, uid, gid = config["stage"], config.get("uid") or 0, config.get("gid") or 0
    new, scratch = os.path.join(stage, "root"), os.path.join(stage, "scratch")
    for folder in (new, scratch):
        _makedirs(folder)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, f"size={SKELETON_BYTES},mode=0755")
    inodes = (config.get("files") or 1 << 40) + INODES_SPARE      # the folders below and the notebook's copy
    _mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"size={config['disk']},nr_inodes={inodes},mode=0755")
    # The writable places: one tmpfs, so one limit holds for all of them together.
    for name, mode in (("tmp", 0o1777), ("var_tmp", 0o1777), ("shm", 0o1777), ("home", 0o700)):
        os.mkdir(os.path.join(scratch, name))
        os.chmod(os.path.join(scratch, name), mode)
    os.chown(os.path.join(scratch, "home"), uid, gid)
    notebook = config.get("notebook")
    if notebook:
        target = os.path.join(scratch, "home", os.path.basename(notebook["name"]))
        with open(notebook["source"], "rb") as src, open(target, "wb") as dst:
            dst.write(src.read())
        os.chown(target, uid, gid)
        os.chmod(target, 0o600)
    for path, writable in ((os.path.join(scratch, "tmp"), "/tmp"), (os.path.join(scratch, "var_tmp"), "/var/tmp"),
                           (os.path.join(scratch, "shm"), "/dev/shm"), (os.path.join(scratch, "home"), HOME)):
        _makedirs(new + writable)
        _mount(path, new + writable, None, MS_BIND)
        _mount(None, new + writable, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV)
    # What Python, torch and course_lib need, read-only, at their own paths (an install below /tmp too, on top
    # of the sandbox's own /tmp); the host's system folders.
    for path in config["binds"]:
        if os.path.lexists(path):
            _bind(path, new + path)
    for device in ("null", "zero", "full", "random", "urandom"):
        _bind(f"/dev/{device}", f"{new}/dev/{device}", writable=True)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{new}/dev/{name}")
    _makedirs(f"{new}/proc")
    _mount("proc", f"{new}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    try:
        _makedirs(f"{new}/dev/mqueue")
        _mount("mqueue", f"{new}/dev/mqueue", "mqueue", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        pass
    name = config.get("user_name") or "sandbox"
    _write_file(f"{new}/etc/passwd", f"root:x:0:0:root:/root:/usr/sbin/nologin\n{name}:x:{uid}:{gid}::{HOME}:"
                                     "/usr/sbin/nologin\nnobody:x:65534:65534::/nonexistent:/usr/sbin/nologin\n")
    _write_file(f"{new}/etc/group", f"root:x:0:\n{name}:x:{gid}:\nnogroup:x:65534:\n")
    _write_file(f"{new}/etc/hosts", "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost\n")
    _write_file(f"{new}/etc/hostname", "sandbox\n")
    _write_file(f"{new}/etc/nsswitch.conf", "passwd: files\ngroup: files\nhosts: files\n")
    _makedirs(f"{new}/root")
    os.chmod(f"{new}/tmp", 0o1777)
    _mount(None, new, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(new)
    _pivot_root_here()
    os.chdir("/")


def _init(config, go_read, report_write, log_fd, keep):
    """The sandbox's first process (PID 1 of its namespace): build the root, start the kernel, reap."""
    try:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.read(go_read, 1)                      # the warden has put this process in the sandbox's cgroups
        os.close(go_read)
        os.umask(0o022)
        _unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWNET | CLONE_NEWUTS)
        _build_root(config)
        _loopback_up()
        try:
            socket.sethostname("sandbox")
        except (OSError, AttributeError):
            pass
        kernel = os.fork()
        if kernel == 0:
            try:
                os.close(report_write)
                _become_kernel(config, log_fd, keep)
            except BaseException as exc:  # noqa: BLE001
                os.write(2, f"the sandbox's kernel could not start: {exc}\n".encode())
            os._exit(127)
    except BaseException as exc:  # noqa: BLE001 - say why to the warden, which tells the judge
        os.write(report_write, f"error {type(exc).__name__}: {exc}\n".encode())
        os._exit(1)
    for fd in (log_fd, *keep):
        os.close(fd)
    os.write(report_write, f"kernel {kernel}\n".encode())
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(0)
        except InterruptedError:
            continue
        if pid == kernel:
            left = [n for n in os.listdir("/proc") if n.isdigit() and n != "1"]
            try:
                os.write(report_write, f"ended {status} {len(left)}\n".encode())
            except OSError:
                pass
            os._exit(0)


def _read_line(fd, timeout):
    line, deadline = b"", time.monotonic() + timeout
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        byte = os.read(fd, 1)
        if not byte:
            break
        line += byte
    return line.decode(errors="replace").strip()


def _map_user_namespace():
    """Without root: a user namespace in which this user is itself (so the sandbox has no capabilities once its
    kernel runs), owning the PID namespace to come."""
    uid, gid = os.getuid(), os.getgid()
    _unshare(CLONE_NEWUSER | CLONE_NEWPID)
    _prctl(PR_SET_DUMPABLE, 1)          # an undumpable process's /proc/self is root's: it could not write its maps
    try:
        _write("/proc/self/uid_map", f"{uid} {uid} 1\n")
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/gid_map", f"{gid} {gid} 1\n")
    finally:
        _prctl(PR_SET_DUMPABLE, 0)


def _start_namespaces(config, log_fd, keep, cgroups):
    """Fork the sandbox's init in a new PID namespace; returns (init pid, kernel pid, report fd)."""
    if config.get("userns"):
        _map_user_namespace()
    else:
        _unshare(CLONE_NEWPID)
    go_read, go_write = os.pipe()
    report_read, report_write = os.pipe()
    init = os.fork()
    if init == 0:
        os.close(go_write)
        os.close(report_read)
        for fd in (0, 1):
            os.dup2(os.open("/dev/null", os.O_RDWR), fd)
        _init(config, go_read, report_write, log_fd, keep)
        os._exit(1)
    os.close(go_read)
    os.close(report_write)
    if cgroups:
        cgroups.add(init)
    os.write(go_write, b"g")
    os.close(go_write)
    line = _read_line(report_read, 60)
    if not line.startswith("kernel "):
        raise RuntimeError(line[6:] if line.startswith("error ") else f"the sandbox's init said {line!r}")
    kernel = _child_of(init)
    return init, kernel, report_read


def _child_of(pid):
    """The (host) pid of `pid`'s only child."""
    for _ in range(500):
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                children = [int(x) for x in f.read().split()]
        except OSError:
            children = [child for child, parent in _parents().items() if parent == pid]
        if children:
            return children[0]
        time.sleep(0.002)
    raise RuntimeError("the sandbox's kernel did not appear")


def _start_plain(config, log_fd, keep, cgroups):
    """Fork the kernel directly below the warden (isolation 'users' or 'none')."""
    go_read, go_write = os.pipe()
    kernel = os.fork()
    if kernel == 0:
        try:
            os.close(go_write)
            os.read(go_read, 1)
            os.close(go_read)
            _become_kernel(config, log_fd, keep)
        except BaseException as exc:  # noqa: BLE001
            os.write(log_fd, f"the sandbox's kernel could not start: {exc}\n".encode())
        os._exit(127)
    os.close(go_read)
    if cgroups:
        cgroups.add(kernel)
    os.write(go_write, b"g")
    os.close(go_write)
    return kernel


def run(config):
    keep = tuple(config.get("keep_fds", ()))
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    _prctl(PR_SET_DUMPABLE, 0)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    # The kernel's own output comes through a pipe and only its last LOG_BYTES are kept: a sandbox that prints
    # without end fills nothing of the host's disk.
    output, log_fd = os.pipe()
    os.set_inheritable(log_fd, True)
    os.set_blocking(output, False)
    log = _Log(output)
    cgroups = None
    if config.get("cgroups") and os.geteuid() == 0:
        cgroups = Cgroups(f"{CGROUP_PREFIX}{os.getpid()}", config["memory"], config["processes"])
        config["cgroup_memory"] = "memory" in cgroups.held
    namespaces = config["isolation"] == "namespaces"
    init, report = None, None
    try:
        if namespaces:
            init, kernel, report = _start_namespaces(config, log_fd, keep, cgroups)
        else:
            kernel = _start_plain(config, log_fd, keep, cgroups)
    except BaseException as exc:  # noqa: BLE001
        os.close(log_fd)
        if init:
            _kill_below(os.getpid(), init)
        if cgroups:
            cgroups.remove()
        log.read()
        log.write(config["log"])
        print(f"failed {type(exc).__name__}: {exc}", flush=True)
        return 1
    for fd in (log_fd, *keep):
        os.close(fd)
    first = init or kernel
    watch = Watch(config, cgroups, first, f"/proc/{init}/root/tmp" if namespaces else None)
    print("started " + json.dumps({"pid": kernel, "limits": watch.how()}), flush=True)
    left_when_ended, status = None, None
    pending = b""
    while not stopping:
        watched = [sys.stdin, output] + ([report] if report is not None else [])
        ready, _, _ = select.select(watched, [], [], POLL)
        if output in ready:
            log.read()
        asked = False
        if sys.stdin in ready:
            data = os.read(sys.stdin.fileno(), 256)
            if not data or b"stop" in data:
                break
            pending += data
            asked = b"\n" in pending
            pending = pending.rsplit(b"\n", 1)[-1]
        ended = False
        if report is not None and report in ready:
            line = _read_line(report, 1)
            if line.startswith("ended"):
                parts = line.split()
                left_when_ended = int(parts[2]) if len(parts) > 2 else 0
                status = int(parts[1]) if len(parts) > 1 and parts[1].lstrip("-").isdigit() else None
            ended = line.startswith("ended") or not line
        reaped = _reap()
        if first in reaped:
            ended = True
            status = reaped[first] if report is None else status
        hit = watch.hit(now=asked or ended)     # a kernel that ended may have been ended by a limit (the OOM killer)
        if hit:
            print(f"limit {hit}", flush=True)
            break
        if ended:
            if status is not None:
                print(f"ended {status}", flush=True)       # its wait status: how it ended (a signal, an exit code)
            break
        if asked:                  # the judge asks after every cell and check: "ok" unless a limit was reached
            print("ok", flush=True)
    log.read()
    left = _kill_below(os.getpid(), first, spare=(kernel,))
    if left_when_ended is not None:
        left = left_when_ended
    if cgroups:
        cgroups.remove()
    log.read()
    log.write(config["log"])
    print(f"clean {left}", flush=True)
    return 0


class _Log:
    """The last LOG_BYTES the kernel wrote to its stdout and stderr."""

    def __init__(self, fd):
        self.fd, self.data = fd, b""

    def read(self):
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                return
            if not chunk:
                return
            self.data = (self.data + chunk)[-LOG_BYTES:]

    def write(self, path):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(self.data)
        except OSError:
            pass


def probe(userns=False):
    """Whether this machine gives a sandbox its namespaces: a child tries them all, a tmpfs and a /proc."""
    pid = os.fork()
    if pid == 0:
        try:
            if userns:
                _map_user_namespace()
            else:
                _unshare(CLONE_NEWPID)
            child = os.fork()
            if child == 0:
                try:
                    _unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWNET | CLONE_NEWUTS)
                    _mount(None, "/", None, MS_REC | MS_PRIVATE)
                    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m")
                    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
                    _loopback_up()
                    if PIVOT_ROOT.get(os.uname().machine) is None:
                        raise OSError(errno.ENOSYS, "pivot_root's number is not known for this machine")
                    os._exit(0)
                except BaseException as exc:  # noqa: BLE001
                    os.write(1, f"{exc}\n".encode())
                    os._exit(1)
            _, status = os.waitpid(child, 0)
            os._exit(os.waitstatus_to_exitcode(status))
        except BaseException as exc:  # noqa: BLE001
            os.write(1, f"{exc}\n".encode())
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) == 0:
        print("ok", flush=True)
        return 0
    return 1


def main(argv):
    if argv[:1] == ["--probe"]:
        return probe(userns="--userns" in argv)
    if argv[:1] == ["--sweep-uid"]:
        folders = [line.strip() for line in sys.stdin if line.strip()] if "--folders" in argv else []
        skip = [f[1:] for f in folders if f.startswith("-")]
        killed, ipc, files = sweep_uid(int(argv[1]), [f for f in folders if not f.startswith("-")], skip,
                                       processes="--files-only" not in argv)
        print(f"clean {killed} {ipc} {files}", flush=True)
        return 0
    line = sys.stdin.buffer.readline(1 << 20)
    return run(json.loads(line))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
