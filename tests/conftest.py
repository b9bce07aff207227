"""Shared helpers for the course_lib tests.

The tests compare course_lib's hand-written collectives with the built-in `torch.distributed` ones
(gloo) inside `course_lib.launch`. To keep the suite fast, one launch runs many cases: the rank
function loops over the cases, collects what went wrong as strings, and the test asserts the list is
empty. Everything here is plain functions so the forked ranks can call them too.

Inputs are random, different on every rank and at every position, and reproducible: any rank can
rebuild any other rank's input from (seed, who), which is how the float tolerances are computed.
"""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
import torch.distributed as dist

import course_lib

DTYPES = (torch.float32, torch.float64, torch.int64, torch.bfloat16)
OPS = ("SUM", "AVG", "PRODUCT", "MAX", "MIN")
TORCH_OPS = {"SUM": dist.ReduceOp.SUM, "AVG": dist.ReduceOp.AVG, "PRODUCT": dist.ReduceOp.PRODUCT,
             "MAX": dist.ReduceOp.MAX, "MIN": dist.ReduceOp.MIN}
WORLD_SIZES = (1, 2, 3, 4, 5, 6)
MILLION = 1_000_003  # "about a million", and not divisible by any world size 2..6


def run(fn, world_size, *args, timeout=60.0, **kwargs):
    """course_lib.launch on gloo (the oracle collectives are gloo's), with the test's own timeout."""
    return course_lib.launch(fn, world_size, args=args, kwargs=kwargs, backend="gloo", timeout=timeout)


def ops_for(dtype):
    """The reduce ops torch allows for `dtype`: AVG only for floating dtypes."""
    return tuple(op for op in OPS if op != "AVG" or dtype.is_floating_point)


def lengths(world_size):
    """0, 1, below the world size, not divisible by it (G+1 and 4G+1), and divisible by it (4G)."""
    return sorted({0, 1, world_size - 1, world_size + 1, 4 * world_size, 4 * world_size + 1})


def make_input(seed, who, shape, dtype, op=None, device=None):
    """Random values for one rank (`who`) and case (`seed`): the same on every call, everywhere.

    Floats are uniform in [-1, 1]; for PRODUCT their size is in [0.8, 1.25] with a random sign,
    so a product over 6 ranks neither overflows nor underflows. Integers stay small enough that no
    sum or product overflows int64.
    """
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    n = math.prod(shape)
    gen = torch.Generator().manual_seed(7919 * seed + 104729 * who + 17)
    if dtype.is_floating_point:
        if op == "PRODUCT":
            size = torch.empty(n, dtype=torch.float64).uniform_(0.8, 1.25, generator=gen)
            sign = torch.randint(0, 2, (n,), generator=gen, dtype=torch.float64) * 2 - 1
            values = size * sign
        else:
            values = torch.empty(n, dtype=torch.float64).uniform_(-1.0, 1.0, generator=gen)
    else:
        low, high = {"PRODUCT": (-3, 4), "MAX": (-10**12, 10**12), "MIN": (-10**12, 10**12)}.get(op, (-1000, 1000))
        values = torch.randint(low, high, (n,), generator=gen, dtype=torch.int64)
    return values.to(dtype).reshape(shape).to(device or course_lib.device())


def strided(tensor):
    """The same values in a non-contiguous layout: every other element of a buffer twice as long."""
    buffer = torch.zeros(*tensor.shape[:-1], 2 * tensor.shape[-1], dtype=tensor.dtype, device=tensor.device)
    view = buffer[..., ::2]
    view.copy_(tensor)
    return view


def gaps_untouched(view):
    """For a tensor made by `strided`: the buffer elements between its elements are still zero.

    A collective may write a strided output only through its own strides, never beside them.
    """
    return view._base is None or bool((view._base[..., 1::2] == 0).all())


def tolerance(inputs, op, dtype):
    """Elementwise bound on |course_lib result - torch result| when reducing `inputs`, or None for exact.

    Integers, MAX and MIN must match exactly. A float SUM in any order is within (G-1) u sum|x| of
    the exact sum (u = unit roundoff = eps / 2), a PRODUCT within (G-1) u |prod|; AVG adds one
    rounding for the division. Two results can each be that far off, so the bound is about
    (G+1) eps * scale: tight enough that a missing or doubled contribution shows up.
    """
    if not dtype.is_floating_point or op in ("MAX", "MIN", None):
        return None
    world_size = len(inputs)
    stacked = torch.stack([x.detach().reshape(-1).cpu().double() for x in inputs])
    if op == "PRODUCT":
        scale = stacked.abs().prod(0)
    else:
        scale = stacked.abs().sum(0) / (world_size if op == "AVG" else 1)
    info = torch.finfo(dtype)
    return (world_size + 1) * info.eps * scale + info.tiny


def mismatch(actual, expected, tol=None, what=""):
    """A description of how `actual` differs from `expected` (None when it does not).

    `tol`: None for bit-exact, else an elementwise bound (see `tolerance`).
    """
    if not isinstance(actual, torch.Tensor):
        return f"{what}: got a {type(actual).__name__}, not a tensor"
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return (f"{what}: got shape {tuple(actual.shape)} {actual.dtype}, expected "
                f"{tuple(expected.shape)} {expected.dtype}")
    a, e = actual.detach().reshape(-1).cpu(), expected.detach().reshape(-1).cpu()
    if tol is None:
        bad = (a != e).nonzero().flatten()
    else:
        bad = ((a.double() - e.double()).abs() > tol.reshape(-1)).nonzero().flatten()
    if bad.numel() == 0:
        return None
    i = int(bad[0])
    bound = "exact" if tol is None else f"tolerance {float(tol.reshape(-1)[i]):.3g}"
    return (f"{what}: {bad.numel()} of {a.numel()} elements differ ({bound}); first at flat index {i}: "
            f"got {a[i].item()!r}, expected {e[i].item()!r}")


def ring_elements_sent(bucket_sizes, rank, world_size):
    """Elements rank `rank` sends in ring all-reduces of buffers of these sizes.

    Scatter-reduce sends every chunk but (rank + 1) mod G (the one it ends up owning), all-gather every
    chunk but (rank + 2) mod G (its right neighbour's, which reaches it last); one rank sends nothing.
    """
    from course_lib import allreduce

    total = 0
    for numel in bucket_sizes:
        sizes = allreduce.chunk_sizes(numel, world_size)
        skipped = sizes[(rank + 1) % world_size] + sizes[(rank + 2) % world_size] if world_size > 1 else 2 * numel
        total += 2 * numel - skipped
    return total


def step_difference(actual_steps, expected_steps, tol=None):
    """None when two runs' per-step parameter vectors agree (bit for bit, or within `tol`), else a
    sentence naming the first step that differs and by how much."""
    if len(actual_steps) != len(expected_steps):
        return f"{len(actual_steps)} steps recorded, expected {len(expected_steps)}"
    for step, (a, e) in enumerate(zip(actual_steps, expected_steps)):
        gap = (a.double() - e.double()).abs().max().item() if a.numel() else 0.0
        if (tol is None and not torch.equal(a, e)) or (tol is not None and not gap < tol):
            bound = "bit-identical" if tol is None else f"within {tol:g}"
            return f"first difference at step {step} (0 = the initial parameters): max gap {gap:.3g}, expected {bound}"
    return None


def digest(tensor):
    """A fingerprint of the tensor's exact bits (to check results are bit-identical across ranks)."""
    raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha1(raw + str(tensor.dtype).encode() + str(tuple(tensor.shape)).encode()).hexdigest()


def assert_no_failures(results, label=""):
    """`results` is launch's list of per-rank failure lists; show every rank's first few failures."""
    lines = []
    for rank, failures in enumerate(results):
        for failure in failures[:8]:
            lines.append(f"rank {rank}: {failure}")
        if len(failures) > 8:
            lines.append(f"rank {rank}: ... and {len(failures) - 8} more")
    assert not lines, f"{label}\n" + "\n".join(lines)


def assert_same_on_every_rank(digests_per_rank, label=""):
    """Each rank returned {case: digest}; every case must have the same digest on every rank."""
    first = digests_per_rank[0]
    differ = [case for case in first if len({d.get(case) for d in digests_per_rank}) != 1]
    assert all(set(d) == set(first) for d in digests_per_rank), f"{label}: ranks ran different cases"
    assert not differ, (f"{label}: results are not bit-identical across ranks for {len(differ)} case(s), "
                        f"e.g. {differ[:5]}")


@pytest.fixture(params=WORLD_SIZES, ids=lambda g: f"G{g}")
def world_size(request):
    return request.param


# -- a kernel that dies while it starts ---------------------------------------------------------------------------
# A Jupyter kernel binds five TCP ports that its manager found free a moment before (jupyter_client picks them, the
# kernel binds them later); on a busy machine, with the other worker's kernels and gloo ranks opening ports at the
# same time, a port can be taken in between, and the kernel exits before its first reply ("Kernel died before
# replying to kernel_info"; a busy CI run lost notebook 05's 22 cells to it once). Such a start is tried again, up
# to 3 times, and the kernel's own stderr (which nbval sends to /dev/null) is kept and shown in a warning, so the
# cause is in the log, and a kernel that dies for a reason of its own (a broken import) still fails, with its
# traceback.
KERNEL_STARTS = 3
_DIED = "Kernel died before replying to kernel_info"


def _kernel_died_at_start(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and _DIED in str(exc)


def _start_kernel_again_if_it_died(start):
    import functools
    import tempfile
    import warnings

    @functools.wraps(start)
    def start_new_kernel(*args, **kwargs):
        for attempt in range(1, KERNEL_STARTS + 1):
            log = tempfile.TemporaryFile()
            kwargs["stderr"] = log
            try:
                return start(*args, **kwargs)
            except RuntimeError as exc:
                log.seek(0)
                said = log.read().decode(errors="replace").strip()[-4000:] or "(nothing)"
                log.close()
                if not _kernel_died_at_start(exc) or attempt == KERNEL_STARTS:
                    raise RuntimeError(f"{exc} (start {attempt} of {KERNEL_STARTS}); the kernel's stderr:\n{said}") \
                        from exc
                warnings.warn(f"a kernel died while it started (start {attempt} of {KERNEL_STARTS}), "
                              f"started again; its stderr:\n{said}", stacklevel=2)
    return start_new_kernel


try:
    import nbval.kernel as _nbval_kernel
except ImportError:             # nbval is a test requirement; without it there are no notebook items to start
    pass
else:
    _nbval_kernel.start_new_kernel = _start_kernel_again_if_it_died(_nbval_kernel.start_new_kernel)


def is_exercise_check(cell) -> bool:
    """An exercise's check cell: nbgrader's `grade` cell that is not a solution (it calls `exercises.check`)."""
    grading = cell.get("metadata", {}).get("nbgrader", {})
    return cell.cell_type == "code" and grading.get("grade", False) and not grading.get("solution", False)


def execute_notebook(client):
    """`client.execute()` (an nbclient.NotebookClient) in a thread of its own, re-raising what it raised.

    pytest-playwright's session fixture keeps an asyncio loop marked as running in the main thread of the
    worker that ran a browser test (its sync API drives the loop from a greenlet). nbclient then takes
    jupyter_core's path for code inside a running loop, which hung a CI run for good (a Colab test after
    a browser test on the same worker). A fresh thread has no running loop, so nbclient behaves as it does
    in a plain script.

    A kernel that dies before it answers (this machine's port race, above) is started again, up to 3 times.
    """
    import threading

    failure = []

    def run():
        try:
            client.execute()
        except BaseException as exc:  # noqa: BLE001 - handed to the calling thread
            failure.append(exc)

    import warnings

    for attempt in range(1, KERNEL_STARTS + 1):
        failure.clear()
        thread = threading.Thread(target=run, name="nbclient", daemon=True)
        thread.start()
        thread.join()
        if not (failure and _kernel_died_at_start(failure[0]) and attempt < KERNEL_STARTS):
            break
        warnings.warn(f"a kernel died while it started (start {attempt} of {KERNEL_STARTS}), started again: "
                      f"{failure[0]}", stacklevel=2)
    if failure:
        raise failure[0]
    return client.nb


# -- how pytest-xdist shares the work between its two workers ------------------------------------------------------
# `--dist loadscope` keeps a notebook's cells (nbval: one kernel) and a test class or module (a module fixture such
# as the grading battery) on one worker. Each notebook's run at the other world sizes
# (test_notebook_world_sizes.py) starts a kernel of its own, so it needs no company: each is a work unit by itself,
# and they go out first, highest notebook number first (the later notebooks run longest; 13, short, is the
# exception), so the longest units start early and the many short ones fill both workers at the end.
WORLD_SIZE_TESTS = "tests/test_notebook_world_sizes.py::test_notebook_runs_at_other_world_sizes["
# Then the units that take 35 s or more, longest first (seconds: their sum of test durations in a quiet run of the test
# command on two workers, 2026-11-27), then the rest in xdist's order (most tests first). In xdist's order the few-test
# units of the browser and Colab tests came last, and one worker ran them for a minute after the other had finished.
# A stale entry costs only time: a unit not listed runs with the rest, a name no longer collected is ignored.
LONG_UNITS = (
    "tests/test_grade_isolation.py",                  # 173: two grading batteries of attacks
    "tests/test_grade.py",                            # 166
    "tests/test_exercises.py",                        # 105
    "tests/test_grade_cheats.py",                     # 88
    "tests/test_grade_batch.py",                      # 82
    "tests/browser/test_jupyterlab.py",               # 71
    "tests/test_launch.py",                           # 65
    "tests/test_exercises_part2.py",                  # 63
    "tests/test_launch.py::TestWhatColabBrings",      # 52
    "tests/test_network.py",                          # 51
    "tests/test_colab.py",                            # 46
    "notebooks/12_fewer_bytes_less_memory.ipynb",     # 45
    "notebooks/11_beat_the_ring.ipynb",               # 44
    "notebooks/10_measure_it.ipynb",                  # 42
    "tests/test_grade_gradescope.py",                 # 38
    "tests/test_assignments.py",                      # 36
)


def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist", None) != "loadscope":
        return None                                         # xdist's own scheduler for any other --dist
    from xdist.scheduler import LoadScopeScheduling

    class WorldSizesFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return nodeid if nodeid.startswith(WORLD_SIZE_TESTS) else super()._split_scope(nodeid)

        def _assign_work_unit(self, node):
            if not getattr(self, "_ordered", False):
                self._ordered = True
                units = list(self.workqueue.items())
                self.workqueue.clear()

                def longest_first(unit):                     # ...world_sizes[12_fewer_bytes_less_memory] -> -12
                    notebook = unit[0][len(WORLD_SIZE_TESTS):][:2]
                    return -int(notebook) if notebook.isdigit() else 0

                first = sorted((u for u in units if u[0].startswith(WORLD_SIZE_TESTS)), key=longest_first)
                by_scope = dict(units)
                long = [(scope, by_scope[scope]) for scope in LONG_UNITS if scope in by_scope]
                rest = [u for u in units if not u[0].startswith(WORLD_SIZE_TESTS) and u[0] not in LONG_UNITS]
                for scope, nodeids in first + long + rest:
                    self.workqueue[scope] = nodeids
            return super()._assign_work_unit(node)

    return WorldSizesFirst(config, log)


# --------------------------------------------------------------------------------------------------
# CPU seconds per test, beside the wall-clock duration (a junit property `cpu_s`)
# --------------------------------------------------------------------------------------------------
# On 2 cores the suite is bound by CPU, not by waiting: what a test costs the run is the CPU its processes use,
# which a wall-clock duration overstates for a test that mostly waits (a timeout, ranks taking turns).
# Counted: the worker itself and every process it and its descendants waited for (a notebook's kernel when it
# shuts down, the ranks a kernel launched, a grader and its users-mode sandboxes). Not counted: a process nobody
# in that chain waited for (a namespaces-mode sandbox, reaped by its own PID namespace's init; a browser's or
# Jupyter server's). A kernel shared by a notebook's cells is counted in the cell during which it ends.

def _cpu_seconds() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item._cpu_at_setup = _cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "teardown" and hasattr(item, "_cpu_at_setup"):
        outcome.get_result().user_properties.append(("cpu_s", round(_cpu_seconds() - item._cpu_at_setup, 2)))
