"""Where a test run's CPU went, process by process, from the kernel's own process accounting.

The junit property `cpu_s` (tests/conftest.py) counts a test's worker and the processes it waited for; it
cannot see the grader's namespaces sandboxes (their own PID namespace's init reaps them), the notebook
kernels nbval and nbclient start, or the browser's servers. Process accounting sees every process that ends,
whoever reaps it:

    apt-get install acct                     # Debian: accton and the accounting file format (v3)
    touch /tmp/pacct && accton /tmp/pacct    # as root, before the run
    python -m pytest ...
    accton off
    python tools/process_census.py /tmp/pacct [--top 25]

It prints the CPU seconds (user + system) by owner (root, or the grader's sandbox users) and command name,
and the sandbox kernels: the grader's Python processes of a sandbox user whose parent is root's (the warden,
or the sandbox's init), counted when they used at least half a second (the rest are the grader's short
probes). One accounting record is written when a process ends; a process still running when accounting
stops is not counted.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import pwd
import struct

# struct acct_v3 (linux/acct.h): flag, version, tty, exitcode, uid, gid, pid, ppid, btime, etime (float),
# then utime, stime, mem, io, rw, minflt, majflt, swaps (comp_t), comm[16]
RECORD = struct.Struct("<BBHIIIIIIf8H16s")
TICKS = 100                           # AHZ: the units of utime and stime


def _comp(value: int) -> int:
    """comp_t: a 13-bit mantissa and a 3-bit base-8 exponent."""
    return (value & 0x1FFF) << (3 * (value >> 13))


def read(path: str) -> list[dict]:
    data = pathlib.Path(path).read_bytes()
    out = []
    for offset in range(0, len(data) - RECORD.size + 1, RECORD.size):
        f = RECORD.unpack_from(data, offset)
        if f[1] != 3:
            raise SystemExit(f"{path}: record {offset // RECORD.size} is not an acct v3 record")
        out.append({"uid": f[4], "pid": f[6], "ppid": f[7], "cpu": (_comp(f[10]) + _comp(f[11])) / TICKS,
                    "command": f[18].split(b"\0")[0].decode(errors="replace")})
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pacct")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    processes = read(args.pacct)
    names = {p.pw_uid: p.pw_name for p in pwd.getpwall()}
    owner = {}
    for uid in {p["uid"] for p in processes}:
        name = names.get(uid, str(uid))
        owner[uid] = name if uid == 0 or not name.startswith("course_lib") else "sandbox " + name.rstrip("0123456789")
    cpu, count = collections.Counter(), collections.Counter()
    for p in processes:
        key = (owner[p["uid"]], p["command"])
        cpu[key] += p["cpu"]
        count[key] += 1
    total = sum(cpu.values())
    print(f"{len(processes)} processes, {total:,.0f} s of CPU")
    for (who, command), seconds in cpu.most_common(args.top):
        print(f"{seconds:9.1f} s {seconds / total:5.1%} {count[who, command]:7d}  {who:<28} {command}")
    by_pid = {p["pid"]: p for p in processes}
    kernels = [p for p in processes if p["uid"] != 0 and p["command"].startswith("python") and p["cpu"] >= 0.5
               and by_pid.get(p["ppid"], {"uid": 0})["uid"] == 0]
    if kernels:
        sandbox = sum(p["cpu"] for p in processes if p["uid"] != 0)
        median = sorted(p["cpu"] for p in kernels)[len(kernels) // 2]
        print(f"sandbox kernels: {len(kernels)}, {sum(p['cpu'] for p in kernels):,.0f} s (median {median:.1f} s "
              f"each); all sandbox users' processes: {sandbox:,.0f} s")


if __name__ == "__main__":
    main()
