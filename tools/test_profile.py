"""Where the test command's time goes: a junit file of `python -m pytest`, summed by area, wall and CPU.

    PYTEST_ADDOPTS="--junitxml=/tmp/run.xml" python -m pytest      # the test command, with a junit file
    python tools/test_profile.py /tmp/run.xml [--top 30]

Wall: each test's duration as pytest reports it (setup, call and teardown). CPU: the `cpu_s` property that
tests/conftest.py records, the CPU seconds of the worker and of every process it waited for during the test (a
notebook's kernel is counted in the cell during which it ends). On 2 cores with 2 workers the run is bound by
whichever runs out first: the workers' wall (their sum over 2) or the cores' CPU (their sum over 2). A test
whose wall is far above its CPU mostly waits (a timeout, ranks taking turns); one whose CPU is above its wall
uses more than one core (ranks, a sandbox beside its judge).
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET


def _area(classname: str, name: str) -> str:
    """The test file (tests/test_x.py -> test_x; a notebook under nbval -> nbval; browser tests -> browser)."""
    parts = classname.split(".")
    if parts[0] == "notebooks" or classname.endswith(".ipynb"):
        return "nbval"
    if parts[:2] == ["tests", "browser"]:
        return "browser"
    return parts[1] if parts[0] == "tests" and len(parts) > 1 else parts[0]


def read(path: str) -> list[dict]:
    """One dict per test: area, name, wall, cpu (None where the run recorded no `cpu_s`)."""
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        cpu = properties.get("cpu_s")
        tests.append({"area": _area(case.get("classname", ""), case.get("name", "")), "name": case.get("name", ""),
                      "wall": float(case.get("time", 0)), "cpu": float(cpu) if cpu is not None else None})
    return tests


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit")
    parser.add_argument("--top", type=int, default=30, help="how many of the costliest tests to list")
    args = parser.parse_args(argv)
    tests = read(args.junit)
    with_cpu = [t for t in tests if t["cpu"] is not None]
    wall, cpu = sum(t["wall"] for t in tests), sum(t["cpu"] for t in with_cpu)
    print(f"{len(tests)} tests; wall {wall:,.0f} s summed ({wall / 2:,.0f} s over 2 workers); "
          + (f"CPU {cpu:,.0f} s summed ({cpu / 2:,.0f} s over 2 cores), {len(with_cpu)} tests with a cpu_s"
             if with_cpu else "no cpu_s recorded (a run before tests/conftest.py recorded it)"))
    areas = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for t in tests:
        area = areas[t["area"]]
        area[0] += 1
        area[1] += t["wall"]
        area[2] += t["cpu"] or 0.0
    print(f"\n{'area':<36}{'tests':>6}{'wall s':>9}{'share':>7}{'CPU s':>9}{'share':>7}")
    for name, (count, area_wall, area_cpu) in sorted(areas.items(), key=lambda kv: -max(kv[1][1], kv[1][2])):
        print(f"{name:<36}{count:>6}{area_wall:>9.0f}{area_wall / wall:>7.0%}{area_cpu:>9.0f}"
              f"{(area_cpu / cpu if cpu else 0):>7.0%}")
    print(f"\nthe {args.top} costliest tests (by the larger of wall and CPU):")
    for t in sorted(tests, key=lambda t: -max(t["wall"], t["cpu"] or 0))[:args.top]:
        cpu_text = f"{t['cpu']:7.1f}" if t["cpu"] is not None else "      -"
        print(f"{t['wall']:7.1f} {cpu_text}  {t['area']}::{t['name'][:90]}")


if __name__ == "__main__":
    main()
