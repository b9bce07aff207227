"""course_lib.progress must not leave an import to its background thread.

A launch forks the ranks. If, at that moment, another thread of the notebook's process is in the middle
of importing a module, the ranks inherit that module's import lock held by a thread that does not exist
in them, and a rank that imports the same module waits forever (seen: notebook 10 with WORLD_SIZE = 3,
every rank stuck in importlib's lock until the launch timed out). The progress line's thread draws a bar
whose helper lives in course_lib.training: that import must happen in the caller's thread.
"""

from __future__ import annotations

import subprocess
import sys


def test_progress_imports_its_bar_helper_in_the_calling_thread():
    code = ("import sys, course_lib\n"
            "assert 'course_lib.training.toy' not in sys.modules\n"
            "loop = course_lib.progress([1, 2], desc='x')\n"
            "next(loop)\n"
            "assert 'course_lib.training.toy' in sys.modules, 'imported later, in another thread'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
