"""The static book (tools/build_book.py), built from the stored notebooks and read in headless Chromium.

The build goes into a temporary folder and is served from a loopback HTTP server. Checked: every
notebook is a page, in course order, with the table of contents; nothing is loaded from outside
the book's folder (it must work offline); every figure has a numbered caption; formulas are typeset;
and the ring stepper moves without a kernel: its slider and its play button change the picture,
whose title names the step the readout names.
"""

from __future__ import annotations

import base64
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import build_book  # noqa: E402

sys.path.remove(str(ROOT / "tools"))


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    pytest.importorskip("nbconvert")
    out = tmp_path_factory.mktemp("book")
    pages = build_book.build(out)
    return out, pages


def test_every_notebook_is_a_page_in_course_order(book):
    out, pages = book
    notebooks = build_book.course_notebooks()
    assert [p.name for p in pages] == ["index.html"] + [f"{n.stem}.html" for n in notebooks]
    index = (out / "index.html").read_text()
    assert re.findall(r'<li><a href="([^"]+)"', index)[: len(notebooks)] == [f"{n.stem}.html" for n in notebooks]
    for position, page in enumerate(pages[1:]):
        text = page.read_text()
        current = re.findall(r'<a [^>]*aria-current="page"[^>]*>', text)
        assert len(current) == 1 and f'href="{page.name}"' in current[0]
        if position + 1 < len(notebooks):
            following = re.findall(r'<a [^>]*rel="next"[^>]*>', text)
            assert following and all(f'href="{notebooks[position + 1].stem}.html"' in a for a in following)
        # Links between chapters go to pages; only the Colab / Binder links open a notebook elsewhere.
        local = [h for h in re.findall(r'href="([^"]+)"', re.sub(r"<pre.*?</pre>", "", text, flags=re.S))
                 if not re.match(r"https?://", h)]
        assert not [h for h in local if ".ipynb" in h], f"{page.name} links a .ipynb inside the book"


def test_nothing_is_loaded_from_outside_the_book(book):
    out, pages = book
    for page in pages:
        text = page.read_text()
        loads = re.findall(r'<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)="([^"]+)"', text)
        outside = [url for url in loads if re.match(r"[a-z]+://|//", url) and not url.startswith("data:")]
        assert not outside, f"{page.name} loads {outside}"
        for url in loads:
            if not url.startswith("data:"):
                assert (out / url.split("?")[0]).exists(), f"{page.name} loads {url}, which is not in the book"


def test_figures_have_numbered_captions(book):
    out, _ = book
    text = (out / "04_ring_scatter_reduce.html").read_text()
    captions = re.findall(r"<figcaption><b>(Figure [\d.]+)\.</b> ?([^<]*)</figcaption>", text)
    assert [label for label, _ in captions] == [f"Figure 4.{k}" for k in range(1, len(captions) + 1)]
    assert len(captions) >= 3 and all(caption.strip() for _, caption in captions), captions
    assert any(caption.startswith("scatter-reduce on 4 ranks") for _, caption in captions), captions


def _svg_title(page) -> str:
    source = page.evaluate("""() => [...document.querySelectorAll('.course-lib-stepper img[data-position]')]
                              .find(img => !img.hidden).getAttribute('src')""")
    svg = base64.b64decode(source.split(",", 1)[1]).decode()
    return next(t for t in re.findall(r"<text[^>]*>([^<]*)</text>", svg) if t == "start" or t.startswith("after "))


def test_the_stepper_moves_without_a_kernel(book, browser, static_server, artifacts):
    out, _ = book
    page = browser.new_page(viewport={"width": 1280, "height": 900}, device_scale_factor=2)
    errors = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    try:
        page.goto(f"{static_server(out)}/04_ring_scatter_reduce.html")
        stepper = page.locator(".course-lib-stepper").first
        controls, readout = stepper.locator(".course-lib-stepper-controls"), stepper.locator("output")
        controls.wait_for(state="visible", timeout=10_000)          # the inline script ran
        assert not stepper.locator(".course-lib-stepper-note").is_visible()
        assert readout.inner_text() == "start" == _svg_title(page)
        stepper.scroll_into_view_if_needed()
        slider = stepper.locator("input[type=range]")
        slider.focus()
        seen = []
        for _ in range(2):
            page.keyboard.press("ArrowRight")
            seen.append((readout.inner_text(), _svg_title(page)))
        assert seen == [("after step 0", "after scatter_reduce step 0"), ("after step 1", "after scatter_reduce step 1")]
        assert stepper.locator("img[data-position]:visible").count() == 1
        stepper.screenshot(path=str(artifacts / "book-04-stepper.png"))
        stepper.locator("button").click()                            # play: on to the last step by itself
        page.wait_for_function("(el) => el.textContent === 'after step 2'", arg=readout.element_handle(),
                               timeout=10_000)
        assert _svg_title(page) == "after scatter_reduce step 2"
        # formulas are typeset by the book's own MathJax
        page.wait_for_selector(".MathJax, .MathJax_Display, mjx-container", state="attached", timeout=20_000)
        assert not errors, errors
    except Exception:
        page.screenshot(path=str(artifacts / "test_book_stepper_failure.png"))
        raise
    finally:
        page.close()
