"""The notebooks in JupyterLab 4, in headless Chromium, as a learner runs them.

For each notebook in NOTEBOOKS: open it, clear its stored outputs, Run All Cells, wait for every
code cell to finish, save, and check
- no cell ended in an error (read from the notebook JupyterLab saved);
- every widget rendered: one widget view in the page per widget output saved, and nowhere the text
  "Loading widget..." or "Error displaying widget";
- every plot is an image the browser loaded, and course_lib's figures carry at least twice the
  pixels they are shown at (sharp at device pixel ratio 2);
- the ring stepper moves: its slider's readout and its picture's title name the same step, the
  picture (an SVG) changes with the slider, and the play button advances it.

One JupyterLab server serves the whole session and the notebooks run one after the other (CI has
two cores). To test another notebook, add its path to NOTEBOOKS.
"""

from __future__ import annotations

import re
import time

import nbformat
import pytest

NOTEBOOKS = [
    "notebooks/00_hello_ranks.ipynb",
    "notebooks/04_ring_scatter_reduce.ipynb",
    "notebooks/07_data_parallel_training.ipynb",
    "assignments/04_ring_scatter_reduce.ipynb",
]
RUN_ALL_TIMEOUT_MS = 300_000   # 07 takes ~15 s alone; CI runs nbval beside it on 2 cores
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
NOTEBOOK = ".jp-NotebookPanel:not(.lm-mod-hidden)"


# The notebook panel of `path` (predicates must be synchronous: Playwright takes a returned Promise
# for a truthy value).
_PANEL = "[...window.jupyterapp.shell.widgets('main')].find(w => w.context && w.context.path === path)"


def open_notebook(page, url, path):
    """Open the notebook, wait until its kernel is up and idle, and make it the current notebook."""
    page.goto(f"{url}/lab/tree/{path}?reset", wait_until="domcontentloaded")
    page.wait_for_function(f"""(path) => {{
        const app = window.jupyterapp;
        if (!app || !app.commands.hasCommand('notebook:run-all-cells')) return false;
        const panel = {_PANEL};
        if (!panel || !panel.context.isReady || !panel.sessionContext.isReady) return false;
        const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
        return !!kernel && kernel.status === 'idle';
    }}""", arg=path, timeout=90_000, polling=250)
    page.evaluate(f"(path) => window.jupyterapp.shell.activateById(({_PANEL}).id)", path)


def command(page, name):
    """Start one of JupyterLab's commands on the current notebook, as its menu item would (without
    waiting for it: Run All's promise resolves only when every cell has run)."""
    page.evaluate("(name) => { window.jupyterapp.commands.execute(name); }", name)


# Every code cell of the notebook has run (or one ended in an error, which stops Run All), and the
# kernel is idle.
_FINISHED = f"""(path) => {{
    const panel = {_PANEL};
    const cells = panel.content.widgets.filter(cell => cell.model.type === 'code');
    const failed = cells.some(cell => cell.model.outputs.toJSON().some(o => o.output_type === 'error'));
    const ran = cells.every(cell => cell.model.executionCount !== null);
    return (failed || ran) && panel.sessionContext.session.kernel.status === 'idle';
}}"""
_CLEARED = f"""(path) => ({_PANEL}).content.widgets
    .every(cell => cell.model.type !== 'code' || (cell.model.executionCount === null && cell.model.outputs.length === 0))"""


def run_all_cells(page, path) -> float:
    """Clear the stored outputs, run every cell, wait until each code cell has run; return the seconds."""
    command(page, "notebook:clear-all-cell-outputs")
    page.wait_for_function(_CLEARED, arg=path, timeout=30_000)
    started = time.monotonic()
    command(page, "notebook:run-all-cells")
    page.wait_for_function(_FINISHED, arg=path, timeout=RUN_ALL_TIMEOUT_MS, polling=500)
    return time.monotonic() - started


def save(page, path):
    """Save from JupyterLab and return the notebook as it wrote it."""
    before = path.stat().st_mtime_ns
    command(page, "docmanager:save")
    deadline = time.monotonic() + 30
    while path.stat().st_mtime_ns == before or page.query_selector(".jp-mod-dirty"):
        assert time.monotonic() < deadline, "JupyterLab did not save the notebook"
        time.sleep(0.2)
    return nbformat.read(path, as_version=4)


def outputs(notebook):
    for index, cell in enumerate(notebook.cells):
        for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
            yield index, output


def shown_widgets(notebook):
    return [o for _, o in outputs(notebook) if o.get("data", {}).get(WIDGET_VIEW, {}).get("model_id")]


def check_no_errors(notebook):
    errors = [f"cell {index}: {o.ename}: {o.evalue}" for index, o in outputs(notebook) if o.output_type == "error"]
    assert not errors, "cells ended in an error:\n" + "\n".join(errors)


def check_widgets(page, notebook):
    """One rendered widget view per widget output saved (views are attached a moment after the
    cell finishes: wait up to 30 s), and no widget placeholder or error text anywhere."""
    expected = len(shown_widgets(notebook))
    views = f"{NOTEBOOK} .jp-OutputArea-output > .jupyter-widgets"
    try:
        page.wait_for_function(
            f"""(expected) => [...document.querySelectorAll('{views}')].filter(v => v.offsetParent !== null).length === expected
                && !/Loading widget|Error displaying widget/.test(document.querySelector('{NOTEBOOK} .jp-Notebook').innerText)""",
            arg=expected, timeout=30_000)
    except Exception:
        text = page.inner_text(f"{NOTEBOOK} .jp-Notebook")
        rendered = page.locator(f"{views}:visible").count()
        problems = sorted(set(re.findall(r"Loading widget\.*|Error displaying widget[^\n]*", text)))
        raise AssertionError(f"{expected} widget outputs saved, {rendered} widget views in the page; {problems}")


def check_images(page, notebook):
    pngs = [o for _, o in outputs(notebook) if "image/png" in o.get("data", {})]
    images = page.evaluate(f"""() => [...document.querySelectorAll(
        '{NOTEBOOK} .jp-OutputArea-output[data-mime-type="image/png"] img')].map(img => (
        {{loaded: img.complete && img.naturalWidth > 0, natural: img.naturalWidth, shown: img.getBoundingClientRect().width}}))""")
    assert len(images) == len(pngs), f"{len(pngs)} PNG outputs saved, {len(images)} images in the page"
    assert all(image["loaded"] for image in images), images
    for output, image in zip(pngs, images):
        if output.get("metadata", {}).get("image/png", {}).get("width"):   # course_lib's figures
            assert image["natural"] >= 1.9 * image["shown"], (
                f"a course_lib figure is shown at {image['shown']:.0f} CSS pixels from a {image['natural']} pixel PNG: "
                "blurry at device pixel ratio 2")
    return len(images)


def _picture(page, image):
    """The stepper picture's SVG text (the widget shows it from a blob: URL)."""
    source = image.get_attribute("src")
    return source, page.evaluate("async (src) => await (await fetch(src)).text()", source)


def _title(svg: str) -> str:
    """The picture's title: its text that starts with 'start' or 'after'."""
    texts = re.findall(r"<text[^>]*>([^<]*)</text>", svg)
    return next(t for t in texts if t == "start" or t.startswith("after "))


def _same_step(label: str, title: str) -> bool:
    if label == "start" or title == "start":
        return label == title
    return label.rsplit(" step ", 1)[1] == title.rsplit(" step ", 1)[1]


def check_steppers(page, notebook, screenshot=None) -> int:
    """Move every ring stepper in the page; return how many there were."""
    steppers = page.locator(f"{NOTEBOOK} .jp-OutputArea-output:has(img.widget-image):has(.widget-slider)")
    for index in range(steppers.count()):
        stepper = steppers.nth(index)
        stepper.scroll_into_view_if_needed()
        image, readout = stepper.locator("img.widget-image"), stepper.locator(".widget-slider .widget-readout")
        source, svg = _picture(page, image)
        assert svg.lstrip().startswith("<?xml") and "<svg" in svg, "the stepper's picture is not an SVG"
        assert readout.inner_text() == "start" == _title(svg)
        width = image.evaluate("img => img.getBoundingClientRect().width")
        assert width > 300, f"the stepper's picture is {width:.0f} pixels wide"
        seen = [(readout.inner_text(), _title(svg))]
        for _ in range(2):
            stepper.locator(".noUi-handle").focus()
            page.keyboard.press("ArrowRight")
            page.wait_for_function("([img, before]) => img.getAttribute('src') !== before",
                                   arg=[image.element_handle(), source], timeout=15_000)
            source, svg = _picture(page, image)
            seen.append((readout.inner_text(), _title(svg)))
        assert [label for label, _ in seen] == ["start", "after step 0", "after step 1"], seen
        assert all(_same_step(label, title) for label, title in seen), f"slider and picture disagree: {seen}"
        if screenshot and index == 0:
            stepper.screenshot(path=str(screenshot))
        # play: the play widget is linked to the slider in the browser, and moves it on by itself
        stepper.locator(".widget-play button").first.click()
        page.wait_for_function("([el, before]) => el.innerText !== before",
                               arg=[readout.element_handle(), seen[-1][0]], timeout=15_000)
        assert readout.inner_text() == "after step 2"
        stepper.locator(".widget-play button").nth(1).click()   # stop
    return steppers.count()


@pytest.mark.parametrize("path", NOTEBOOKS)
def test_notebook_runs_in_jupyterlab(page, jupyter_lab, artifacts, path):
    url, root = jupyter_lab
    open_notebook(page, url, path)
    seconds = run_all_cells(page, path)
    notebook = save(page, root / path)
    check_no_errors(notebook)
    check_widgets(page, notebook)
    images = check_images(page, notebook)
    stem = path.replace("/", "_").removesuffix(".ipynb")
    steppers = check_steppers(page, notebook, screenshot=artifacts / f"{stem}-stepper.png")
    if any("viz.Stepper(" in cell.source for cell in notebook.cells):
        assert steppers >= 1, "the notebook makes a Stepper, but none is in the page"
    print(f"{path}: all cells ran in {seconds:.1f} s; {images} images, {len(shown_widgets(notebook))} widgets, "
          f"{steppers} stepper(s) checked")
