"""Build the course as a static website from the executed notebooks: no kernel, no network.

    python tools/build_book.py                  # -> build/book/index.html
    python tools/build_book.py --out DIR        # somewhere else

Open build/book/index.html in a browser (or serve the folder: python -m http.server -d build/book).
Every page is a notebook as it is stored (its outputs come from tools/execute_notebooks.py), in
course order with a table of contents and previous/next links. Figures get numbered captions (a
course_lib figure's own title, else the cell's "caption" metadata, else the sentence before it);
the ring steppers move without a kernel, from the static HTML version their outputs carry
(`viz.Stepper.static_html`); other widgets, which need a kernel, are left out.

Why nbconvert and not jupyter-book 2 / MyST or mkdocs-jupyter: the book must build and be read with
no network. MyST downloads its book theme on the first build; mkdocs-jupyter's current release needs
Python 3.12 and brings mkdocs and a theme that fetches fonts unless told not to. nbconvert comes with
JupyterLab (which the tests install anyway) and its JupyterLab template, with the few blocks that
load scripts from a CDN emptied (tools/book/book.html.j2), renders the pages exactly as JupyterLab
shows them. MathJax is copied from the jupyter-server-mathjax package when it is installed; without
it, formulas show as their TeX source.
"""

from __future__ import annotations

import argparse
import copy
import html
import pathlib
import re
import shutil
import sys

import nbformat

ROOT = pathlib.Path(__file__).resolve().parent.parent
TEMPLATE_DIR = ROOT / "tools" / "book"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
MATHJAX_CONFIG = "TeX-AMS-MML_HTMLorMML-full,Safe"


def course_notebooks() -> list[pathlib.Path]:
    """The course's notebooks in course order (their names start with the chapter number)."""
    return sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def title_of(notebook, path: pathlib.Path) -> str:
    """The notebook's first heading, e.g. '04 · Ring all-reduce, phase 1: scatter-reduce'."""
    for cell in notebook.cells:
        if cell.cell_type == "markdown":
            match = re.search(r"^#\s+(.+)$", cell.source, re.M)
            if match:
                return _plain(match.group(1))
    return path.stem


def _plain(markdown: str) -> str:
    """Markdown to one line of text, for captions: links, emphasis and code marks dropped."""
    text = re.sub(r"!\[[^\]]*\]\([^)]*\)", "", markdown)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[*_`#>]", "", text)
    return " ".join(text.split())


def _last_sentence(markdown: str) -> str:
    sentences = re.split(r"(?<=[.:!?])\s+", _plain(markdown))
    sentences = [s for s in sentences if s]
    return sentences[-1] if sentences else ""


def _figure_html(png_b64: str, metadata: dict, label: str, caption: str) -> str:
    size = "".join(f' {key}="{int(metadata[key])}"' for key in ("width", "height") if key in metadata)
    alt = html.escape(caption or label, quote=True)
    text = f"<b>{label}.</b> {html.escape(caption)}" if caption else f"<b>{label}.</b>"
    return (f'<figure class="book-figure"><img src="data:image/png;base64,{png_b64}"{size} alt="{alt}">'
            f"<figcaption>{text}</figcaption></figure>")


def prepare(notebook, chapter: str):
    """A copy of the notebook ready for a page without a kernel.

    - widget outputs: the static HTML they carry (the Stepper's), else nothing (a widget needs a kernel);
    - every PNG becomes a numbered <figure> with a caption, shown at the size its metadata gives;
    - the saved widget state goes (nothing on the page could use it);
    - the "Open in Colab" / "launch Binder" badges become plain text links: the badge images live on
      colab.research.google.com and mybinder.org, and a book page loads nothing from outside the book.
    """
    notebook = copy.deepcopy(notebook)
    notebook.metadata.pop("widgets", None)
    figures, previous_markdown = 0, ""
    for cell in notebook.cells:
        if cell.cell_type == "markdown" and "badges" in cell.metadata.get("tags", []):
            cell.source = _badges_as_text(cell.source)
            continue
        if cell.cell_type == "markdown":
            previous_markdown = cell.source
            continue
        if cell.cell_type != "code":
            continue
        kept = []
        for output in cell.get("outputs", []):
            data = output.get("data")
            if data is not None and WIDGET_VIEW in data:
                if "text/html" not in data:
                    continue
                output.data = {"text/html": data["text/html"]}
            elif data is not None and "image/png" in data:
                figures += 1
                metadata = output.get("metadata", {}).get("image/png", {})
                caption = (metadata.get("caption") or cell.metadata.get("caption")
                           or _last_sentence(previous_markdown))
                output.data = {"text/html": _figure_html(data["image/png"], metadata, f"Figure {chapter}.{figures}",
                                                          caption)}
                output.metadata = {}
            kept.append(output)
        cell.outputs = kept
    return notebook


def _badges_as_text(markdown: str) -> str:
    """'[![Open In Colab](badge.svg)](url) [![launch Binder](logo.svg)](url)' -> 'Run this chapter: [Open in Colab](url) · ...'."""
    links = re.findall(r"\[!\[([^\]]*)\]\([^)]*\)\]\(([^)]*)\)", markdown)
    if not links:
        return markdown
    return "Run this chapter: " + " · ".join(f"[{label}]({url})" for label, url in links)


def _nav(pages, current: int | None) -> str:
    items = []
    for index, (_, href, title) in enumerate(pages):
        here = ' aria-current="page"' if index == current else ""
        items.append(f'<li><a href="{href}"{here}>{html.escape(title)}</a></li>')
    return (f'<nav class="book-nav" aria-label="chapters"><h2><a href="index.html">course_lib</a></h2>'
            f'<ol>{"".join(items)}</ol></nav>')


def _pager(pages, index: int) -> str:
    before = f'<a rel="prev" href="{pages[index - 1][1]}">← {html.escape(pages[index - 1][2])}</a>' if index else "<span></span>"
    after = (f'<a rel="next" href="{pages[index + 1][1]}">{html.escape(pages[index + 1][2])} →</a>'
             if index + 1 < len(pages) else "<span></span>")
    return f'<div class="book-pager">{before}{after}</div>'


def _link_pages(page: str) -> str:
    """Links between notebooks point at their pages: href="04_x.ipynb" -> href="04_x.html"."""
    return re.sub(r'href="([^":#]+)\.ipynb(#[^"]*)?"', lambda m: f'href="{m.group(1)}.html{m.group(2) or ""}"', page)


def _copy_mathjax(out: pathlib.Path) -> str:
    """Copy MathJax next to the pages; return the URL the pages load it from ('' if not installed)."""
    try:
        import jupyter_server_mathjax
    except ImportError:
        print("jupyter-server-mathjax is not installed: formulas will show as TeX", file=sys.stderr)
        return ""
    static = pathlib.Path(jupyter_server_mathjax.__file__).parent / "static"
    target = out / "mathjax"
    if not target.exists():
        # The SVG output and the PNG image fonts are never used with the HTML-CSS configuration.
        shutil.copytree(static, target, ignore=shutil.ignore_patterns("SVG", "*.png"))
    return f"mathjax/MathJax.js?config={MATHJAX_CONFIG}"


def build(out: pathlib.Path, paths: list[pathlib.Path] | None = None) -> list[pathlib.Path]:
    """Write the book into `out`; return the pages written (index.html first)."""
    from nbconvert import HTMLExporter

    paths = paths or course_notebooks()
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(TEMPLATE_DIR / "book.css", out / "book.css")
    mathjax_url = _copy_mathjax(out)
    notebooks = [nbformat.read(path, as_version=4) for path in paths]
    pages = [(path, f"{path.stem}.html", title_of(nb, path)) for path, nb in zip(paths, notebooks)]
    exporter = HTMLExporter(template_name="lab", extra_template_paths=[str(TEMPLATE_DIR)],
                            template_file="book.html.j2", mathjax_url=mathjax_url)
    written = []
    for index, (notebook, (path, href, title)) in enumerate(zip(notebooks, pages)):
        chapter = str(int(path.name[:2])) if path.name[:2].isdigit() else str(index)
        resources = {"metadata": {"name": title}, "book_nav": _nav(pages, index), "book_pager": _pager(pages, index)}
        page, _ = exporter.from_notebook_node(prepare(notebook, chapter), resources=resources)
        (out / href).write_text(_link_pages(page), encoding="utf-8")
        written.append(out / href)
    contents = "".join(f'<li><a href="{href}">{html.escape(title)}</a></li>' for _, href, title in pages)
    index_page = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<title>course_lib: how many GPUs train one model</title><link rel="stylesheet" href="book.css"></head>'
        f'<body class="book-page">{_nav(pages, None)}<main><h1>course_lib</h1>'
        "<p>How do many GPUs train one model and stay in step? Each chapter is a notebook of the course, "
        "shown as it was last run: every picture and number on these pages was made by the code above it. "
        "To run them yourself, open <code>notebooks/</code> in JupyterLab.</p>"
        f"<ol>{contents}</ol></main></body></html>\n")
    (out / "index.html").write_text(index_page, encoding="utf-8")
    return [out / "index.html"] + written


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "build" / "book", help="where to write the book")
    parser.add_argument("notebooks", nargs="*", type=pathlib.Path, help="default: every notebook in notebooks/")
    args = parser.parse_args(argv)
    pages = build(args.out, [p.resolve() for p in args.notebooks] or None)
    print(f"{len(pages)} pages in {args.out}; open {args.out / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
