"""The library's shape: no import cycle, a light `import course_lib`, a short path for one ring.

docs/architecture.md draws the layers these hold.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import import_cycles  # noqa: E402
import trace_ring  # noqa: E402


def test_no_module_imports_one_that_imports_it_back():
    assert import_cycles.cycles() == []
    assert {"course_lib.allreduce", "course_grader.judge"} <= set(import_cycles.modules())   # both packages read


def test_the_learners_package_never_imports_the_grader():
    known = import_cycles.modules()
    reaches = {name: import_cycles._edges(name, path, known) for name, path in known.items()
               if name.startswith("course_lib")}
    assert not {name: sorted(t for t in targets if t.startswith("course_grader"))
                for name, targets in reaches.items() if any(t.startswith("course_grader") for t in targets)}


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import(tmp_path, monkeypatch):
    package = tmp_path / "toy"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("def f():\n    from toy import high\n")
    (package / "high.py").write_text("from toy import low\n")
    (package / "typed.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from toy import high\n")
    monkeypatch.setattr(import_cycles, "ROOT", tmp_path)
    assert import_cycles.cycles("toy") == [["toy.high", "toy.low"]]


_LOADED = """
import json, sys
before = set(sys.modules)
import course_lib
loaded = sorted(m for m in sys.modules if m.startswith("course_lib") and m not in before)
lines = sum(len(open(sys.modules[m].__file__).read().splitlines()) for m in loaded)
print(json.dumps({"modules": loaded, "lines": lines}))
"""


def test_import_course_lib_loads_the_learners_layers_only():
    out = subprocess.run([sys.executable, "-c", _LOADED], capture_output=True, text=True, check=True, cwd=ROOT)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded["lines"] <= 3000, loaded
    heavy = ("simulation", "_maestro", "modeled_clock", "nccl", "schedules", "network", "backend", "exercises",
             "grade", "training", "viz", "bench", "fast_allreduce", "launch_diagnosis", "torchrun")
    assert not [m for m in loaded["modules"] if m.split(".")[1:2] and m.split(".")[1] in heavy], loaded["modules"]


def test_what_is_loaded_on_first_use_is_what_the_names_say():
    import course_lib
    from course_lib import allreduce, fast_allreduce, network

    assert course_lib.Network is network.Network and course_lib.Cluster is network.Cluster
    assert course_lib.network is network
    assert allreduce.VARIANTS["tree"] is fast_allreduce.tree and allreduce.get("ring") is allreduce.ring
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        course_lib.nothing_here  # noqa: B018


def test_one_ring_runs_through_few_lines_of_the_library():
    table = trace_ring.trace(world_size=4, numel=1003)
    assert "allreduce.py" in table and "p2p.py" in table
    assert sum(table.values()) <= 250, table
    # the algorithms, their messages and labels, the reductions, and one runtime module beside them
    assert len(table) <= 5, table
    assert set(table) <= {"allreduce.py", "p2p.py", "traffic.py", "ops.py", "runtime.py"}, table


def test_the_grader_moved_out_of_course_lib_and_the_old_name_says_where():
    imported = subprocess.run([sys.executable, "-c", "import course_lib.grade"], capture_output=True, text=True, cwd=ROOT)
    assert imported.returncode != 0 and "ImportError" in imported.stderr, imported.stderr
    assert "course_grader" in imported.stderr and "pip install" in imported.stderr, imported.stderr
    run = subprocess.run([sys.executable, "-m", "course_lib.grade", "--class", "x"], capture_output=True, text=True,
                         cwd=ROOT)
    assert run.returncode == 1 and "python -m course_grader" in run.stderr and "Traceback" not in run.stderr, run.stderr
    import course_grader

    assert course_grader.__file__.startswith(os.path.join(ROOT, "course_grader"))
