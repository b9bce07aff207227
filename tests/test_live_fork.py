"""course_lib.progress must not leave an import to its background thread.

A launch forks the ranks. If, at that moment, another thread of the notebook's process is in the middle
of importing a module, the ranks inherit that module's import lock held by a thread that does not exist
in them, and a rank that imports the same module waits forever (seen: notebook 10 with WORLD_SIZE = 3,
every rank stuck in importlib's lock until the launch timed out). The progress line's thread draws a
bar; its helper used to live in course_lib.training and be imported on first use. It now lives in
course_lib._util, which `import course_lib` has loaded already: a whole loop imports nothing.
"""

from __future__ import annotations

import subprocess
import sys


def test_the_live_lines_bar_imports_nothing():
    # What the live line's thread calls (_bar) must import nothing, even the first time; the calling
    # thread may import what it likes (it asks IPython whether it runs in a kernel, for one).
    code = ("import sys, course_lib\n"
            "from course_lib import live\n"
            "list(course_lib.progress([1, 2, 3], desc='x'))   # the caller's imports happen here\n"
            "assert 'course_lib.training' not in sys.modules, 'progress imported course_lib.training'\n"
            "before = set(sys.modules)\n"
            "live._bar(1, 3), live._bar(2, None)\n"
            "new = sorted(set(sys.modules) - before)\n"
            "assert not new, f'drawing the bar imported {new}'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_bar_is_the_training_loops_bar():
    from course_lib import _util, live, training

    assert training.progress_bar is _util.progress_bar
    assert live._bar(3, 6) == training.progress_bar(3, 6) == "[############------------] 3/6"
    assert live._bar(5, None) == "5 done"
