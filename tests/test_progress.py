"""course_lib.live: live progress in a Jupyter kernel that leaves no trace in the stored outputs.

The kernel tests run code in a real ipykernel (as JupyterLab and nbval do) and read every message
the kernel sends: a launch that runs longer than DELAY must show a per-rank status line that
changes while it runs (what the ranks' `progress` loops and prints say), and remove it at the end;
a quick launch must send nothing extra. What nbval compares and what tools/execute_notebooks.py
stores must be exactly what the cell prints without the live line.
"""

import pathlib
import sys
import time

import pytest

import course_lib
from course_lib import live, runtime

pytest.importorskip("ipykernel")
pytest.importorskip("ipywidgets")

ROOT = pathlib.Path(__file__).resolve().parent.parent
VIEW = "application/vnd.jupyter.widget-view+json"

SLOW_LAUNCH = """
import time, course_lib
def work(rank, world_size):
    for epoch in course_lib.progress(range(3), desc="epoch"):
        print(f"epoch {epoch} done")
        time.sleep(1.0)
    return rank
print(course_lib.launch(work, world_size=2, backend="gloo"))
"""

QUICK_LAUNCH = """
import course_lib
print(course_lib.launch(lambda rank, world_size: rank, world_size=2, backend="gloo"))
"""

SWEEP = """
import time, course_lib
for size in course_lib.progress([2, 3, 4], desc="world size"):
    time.sleep(1.0)
print("swept")
"""


@pytest.fixture(scope="module")
def kernel():
    from jupyter_client.manager import start_new_kernel

    manager, client = start_new_kernel(kernel_name="python3", cwd=str(ROOT))
    yield client
    client.stop_channels()
    manager.shutdown_kernel(now=True)


def _run(client, code, timeout=60):
    """Execute `code`; return every iopub message it caused, in order (status and input left out)."""
    msg_id = client.execute(code)
    messages, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = client.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind = msg["msg_type"]
        if kind == "status" and msg["content"]["execution_state"] == "idle":
            return messages
        if kind not in ("status", "execute_input"):
            messages.append(msg)
    raise TimeoutError(code)


def _html_values(messages):
    """Every value an HTML widget was given, in order (comm_open states and updates)."""
    values = []
    for msg in messages:
        data = msg["content"].get("data", {})
        state = data.get("state", {})
        if msg["msg_type"] in ("comm_open", "comm_msg") and "value" in state:
            values.append(state["value"])
    return values


def _streams(messages):
    return "".join(m["content"]["text"] for m in messages if m["msg_type"] == "stream")


def test_a_slow_launch_shows_each_rank_live_and_leaves_nothing(kernel):
    messages = _run(kernel, SLOW_LAUNCH)
    kinds = [m["msg_type"] for m in messages]
    displays = [m for m in messages if m["msg_type"] == "display_data"]
    assert len(displays) == 1 and set(displays[0]["content"]["data"]) == {VIEW}, displays
    model_id = displays[0]["content"]["data"][VIEW]["model_id"]
    assert model_id
    values = _html_values(messages)
    # shown after DELAY, refreshed while the ranks work: their progress, then "finished"
    assert len(set(values)) >= 2, values
    assert any("rank 0 · epoch [" in v and "rank 1 · epoch [" in v for v in values), values
    assert any("epoch 2/3" in v or " 2/3" in v for v in values), values
    assert "running for" in values[0]
    # removed at the end: the view is replaced by a view of nothing, the widget is closed
    updates = [m for m in messages if m["msg_type"] == "update_display_data"]
    assert [u["content"]["data"][VIEW]["model_id"] for u in updates] == [""]
    assert kinds.index("update_display_data") > max(i for i, k in enumerate(kinds) if k == "comm_msg" and
                                                    "value" in messages[i]["content"]["data"].get("state", {}))
    assert "comm_close" in kinds
    # the cell's text is what it is without the live line
    assert _streams(messages) == ("[rank 0] epoch 0 done\n[rank 0] epoch 1 done\n[rank 0] epoch 2 done\n"
                                  "[rank 1] epoch 0 done\n[rank 1] epoch 1 done\n[rank 1] epoch 2 done\n[0, 1]\n")


def test_a_quick_launch_sends_nothing_extra(kernel):
    messages = _run(kernel, QUICK_LAUNCH)
    # Only the printed text, in one stream message or two (a busy kernel may flush "[0, 1]" before its newline).
    assert {m["msg_type"] for m in messages} == {"stream"} and _streams(messages) == "[0, 1]\n"


def test_a_sweep_in_the_notebook_shows_a_bar_then_goes(kernel):
    messages = _run(kernel, SWEEP)
    values = _html_values(messages)
    assert values and all("world size [" in v for v in values), values
    assert any("now: world size 4" in v for v in values) or any("now: world size 3" in v for v in values)
    assert [u["content"]["data"][VIEW]["model_id"] for u in messages if u["msg_type"] == "update_display_data"] == [""]
    assert _streams(messages) == "swept\n"


def test_running_shows_the_seconds_then_goes(kernel):
    messages = _run(kernel, "import time, course_lib.live as live\n"
                            "with live.running('torchrun: 2 ranks'):\n    time.sleep(3.2)\nprint('done')")
    values = _html_values(messages)
    assert values and all("torchrun: 2 ranks · " in v for v in values) and any(" · 3 s" in v for v in values), values
    assert [u["content"]["data"][VIEW]["model_id"] for u in messages if u["msg_type"] == "update_display_data"] == [""]
    assert _streams(messages) == "done\n"


def test_stored_notebook_and_nbval_see_only_the_printed_text(tmp_path):
    """Executed the way tools/execute_notebooks.py stores notebooks: no output, no widget state left
    from the live line; and the one output nbval would collect carries no key it compares."""
    nbformat = pytest.importorskip("nbformat")
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import execute_notebooks
    finally:
        sys.path.remove(str(ROOT / "tools"))
    path = tmp_path / "slow.ipynb"
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(SLOW_LAUNCH)]
    nbformat.write(notebook, path)
    execute_notebooks.execute(path)
    stored = nbformat.read(path, as_version=4)
    assert {o["output_type"] for o in stored.cells[0].outputs} == {"stream"}
    assert "".join(o["text"] for o in stored.cells[0].outputs).endswith("[rank 1] epoch 2 done\n[0, 1]\n")
    assert "widgets" not in stored.metadata


def test_outside_a_kernel_progress_passes_items_through(capsys):
    assert list(course_lib.progress(iter("abc"), desc="letter")) == ["a", "b", "c"]
    assert capsys.readouterr() == ("", "")
    assert not live.in_jupyter_kernel()


def _report_progress(rank, world_size):
    """In a rank: loop with progress, and read back the progress part of the rank's shared status
    file (the memory the launcher's reader sees) at every item and after the loop."""
    def seen():
        region = bytes(runtime._slot[runtime.SLOT_BYTES:])
        return region.split(b"\0", 1)[0].decode()
    lines = [seen() for _ in course_lib.progress(range(4), desc="epoch")]
    return lines + [seen()]


def test_progress_in_a_rank_writes_the_line_the_launcher_reads():
    from course_lib.training import progress_bar

    expected = [f"epoch {progress_bar(k, 4)}" for k in range(4)] + [""]   # cleared when the loop ends
    assert course_lib.launch(_report_progress, 2, backend="gloo") == [expected, expected]


def test_rank_line_reads_progress_output_and_blocked_call(tmp_path):
    status, stdout = str(tmp_path / "status"), str(tmp_path / "stdout")
    runtime.create_slot_file(status)
    pathlib.Path(stdout).write_text("epoch 1 done\nloss 0.5\n\n")
    line = live.LaunchStatus(1, lambda r: status, lambda r: stdout)
    assert line.rank_line(0) == "rank 0 · loss 0.5 · running"
    runtime.attach(status)
    try:
        runtime.set_blocked("recv(src=1, shape=(4,), dtype=torch.float32)")
        runtime.set_progress("epoch [###---] 1/2")
        assert line.rank_line(0) == "rank 0 · epoch [###---] 1/2 · in recv(src=1, shape=(4,), dtype=torch.float32)"
        assert runtime.read_slot_file(status) == "recv(src=1, shape=(4,), dtype=torch.float32)"
        runtime.set_blocked("finished")
        assert line.rank_line(0).endswith("finished, waits for the others")
    finally:
        runtime.detach()
