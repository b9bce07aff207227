"""Stamp every notebook and README.md from the repository's one address in pyproject.toml.

    python tools/stamp_notebooks.py            # notebooks/, assignments/ (when present) and README.md
    python tools/stamp_notebooks.py some/dir x.ipynb   # only these notebooks or folders of notebooks
    python tools/stamp_notebooks.py --check    # change nothing; list what is out of step, exit 1 if any

The address is `Repository` in `[project.urls]`; change it there, run this, commit. From it come:

* a first markdown cell in every notebook (tagged "badges"): "Open in Colab" and "launch Binder"
  links to that very notebook;
* the first code cell of every notebook (tagged "setup"): it makes `import course_lib` work, from
  the clone the notebook sits in, else by `pip install "course_lib @ git+<address>[@<tag>]"`.
  The address sits in one variable that the environment variable COURSE_LIB_SOURCE overrides
  (the Colab test points it at a local clone; the install goes through the same line);
* README.md: whatever lies between `<!-- stamp:NAME -->` and `<!-- /stamp:NAME -->` (NAME is
  "badges", "install" or "clone").

Which git ref: when `version` in `[project]` is a release (0.2.0, 0.2.0.post1) the notebooks install
and open the release tag `v{version}`; while it is a development version (0.2.0.dev0) they follow
`default-branch` from `[tool.course_lib]`. The ref is read from pyproject.toml, never from local git
tags, so every clone (shallow CI clones included) stamps the same bytes; a release commit names its
own tag before the tag exists. Only the badge and setup cells are touched: every other cell stays
byte for byte as it was, so this can run again after any merge. Running it twice changes nothing.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
import urllib.parse
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK_FOLDERS = ("notebooks", "assignments")
BADGES_TAG, SETUP_TAG = "badges", "setup"
SOURCE_VARIABLE = "COURSE_LIB_SOURCE"  # the cell's variable and the environment variable that overrides it
COLAB_BADGE = "https://colab.research.google.com/assets/colab-badge.svg"
BINDER_BADGE = "https://mybinder.org/badge_logo.svg"


@dataclass(frozen=True)
class Project:
    address: str         # https://github.com/owner/name, no trailing slash, no .git
    version: str
    default_branch: str

    @property
    def is_release(self) -> bool:
        return re.fullmatch(r"\d+(\.\d+)*(\.post\d+)?", self.version) is not None

    @property
    def ref(self) -> str:
        """The git ref notebooks install and open: the release tag, or the default branch."""
        return f"v{self.version}" if self.is_release else self.default_branch

    @property
    def pip_url(self) -> str:
        """What follows `course_lib @` in the install line."""
        return f"git+{self.address}" + (f"@{self.ref}" if self.is_release else "")

    @property
    def github(self) -> tuple[str, str] | None:
        match = re.fullmatch(r"https://github\.com/([^/]+)/([^/]+)", self.address)
        return (match.group(1), match.group(2)) if match else None


def read_project(root: pathlib.Path = ROOT) -> Project:
    """The address, version and default branch from `root`/pyproject.toml."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    with open(root / "pyproject.toml", "rb") as f:
        data = tomllib.load(f)
    urls = data["project"].get("urls", {})
    if "Repository" not in urls:
        raise SystemExit("pyproject.toml has no Repository in [project.urls]: put the repository's address there.")
    address = urls["Repository"].rstrip("/").removesuffix(".git")
    if not re.fullmatch(r"https://[^\s\"'{}]+", address):
        raise SystemExit(f"[project.urls] Repository must be an https:// address, not {address!r}.")
    branch = data.get("tool", {}).get("course_lib", {}).get("default-branch", "main")
    return Project(address=address, version=data["project"]["version"], default_branch=branch)


# --------------------------------------------------------------------------------------------------
# what gets stamped
# --------------------------------------------------------------------------------------------------


def colab_url(project: Project, relpath: str) -> str | None:
    """Colab opens notebooks from GitHub only; None for any other host."""
    if project.github is None:
        return None
    owner, name = project.github
    return f"https://colab.research.google.com/github/{owner}/{name}/blob/{project.ref}/{relpath}"


def binder_url(project: Project, relpath: str | None = None) -> str:
    """mybinder.org builds the repository at `ref` and opens `relpath` in JupyterLab (or the file browser)."""
    if project.github is not None:
        owner, name = project.github
        base = f"https://mybinder.org/v2/gh/{owner}/{name}/{project.ref}"
    else:
        base = f"https://mybinder.org/v2/git/{urllib.parse.quote(project.address, safe='')}/{project.ref}"
    return base + "?urlpath=" + urllib.parse.quote(f"lab/tree/{relpath or ''}", safe="")


def badges_markdown(project: Project, relpath: str | None) -> str:
    """The badge line: for one notebook (relpath), or for the README (None: Colab opens the first notebook)."""
    links = []
    colab = colab_url(project, relpath or "notebooks/00_hello_ranks.ipynb")
    if colab:
        links.append(f"[![Open In Colab]({COLAB_BADGE})]({colab})")
    links.append(f"[![launch Binder]({BINDER_BADGE})]({binder_url(project, relpath or 'notebooks')})")
    return " ".join(links)


def install_line(project: Project) -> str:
    return f'pip install "course_lib @ {project.pip_url}"'


def clone_line(project: Project) -> str:
    """How an instructor gets the repository (the grader, the student copies), at the ref notebooks install."""
    branch = f" --branch {project.ref}" if project.is_release else ""
    return f"git clone{branch} {project.address} && cd {project.address.rsplit('/', 1)[-1]}"


def setup_cell_source(project: Project) -> str:
    return (
        "# Setup: makes `import course_lib` work, from the clone this notebook sits in or else\n"
        "# (Colab, a notebook downloaded alone) by installing it from the course's repository.\n"
        "import importlib.util, os, pathlib, sys\n"
        f'{SOURCE_VARIABLE} = os.environ.get("{SOURCE_VARIABLE}", "{project.pip_url}")\n'
        'if importlib.util.find_spec("course_lib") is None:\n'
        '    clones = [p for p in pathlib.Path.cwd().resolve().parents if (p / "course_lib" / "__init__.py").exists()]\n'
        "    if clones:\n"
        "        sys.path.insert(0, str(clones[0]))\n"
        "    else:\n"
        f'        %pip install -q "course_lib @ {{{SOURCE_VARIABLE}}}"\n'
        "import course_lib  # if this fails, pip's message just above says why\n"
        "course_lib.check_torch()  # one line if this runtime's PyTorch is older than the notebooks need"
    )


# --------------------------------------------------------------------------------------------------
# applying it
# --------------------------------------------------------------------------------------------------


def _source(cell) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def _tagged(cell, tag) -> bool:
    return tag in cell.get("metadata", {}).get("tags", [])


def _new_cell(notebook, cell_type: str, tag: str, source: str) -> dict:
    cell = {"cell_type": cell_type, "metadata": {"tags": [tag]}, "source": _lines(source)}
    if cell_type == "code":
        cell.update(execution_count=None, outputs=[])
    if (notebook.get("nbformat"), notebook.get("nbformat_minor", 0)) >= (4, 5):
        cell["id"] = f"{tag}-cell"  # fixed, so stamping twice gives the same bytes
    return cell


def stamp_notebook(text: str, project: Project, relpath: str) -> str:
    """The notebook `text` with its badge cell and setup cell made from `project`; other cells untouched."""
    notebook = json.loads(text)
    cells = [c for c in notebook["cells"] if not (c["cell_type"] == "markdown" and _tagged(c, BADGES_TAG))]
    badge = badges_markdown(project, relpath)
    old_badges = [c for c in notebook["cells"] if c["cell_type"] == "markdown" and _tagged(c, BADGES_TAG)]
    badge_cell = old_badges[0] if old_badges else _new_cell(notebook, "markdown", BADGES_TAG, badge)
    badge_cell["source"] = _lines(badge)
    cells.insert(0, badge_cell)

    first_code = next((i for i, c in enumerate(cells) if c["cell_type"] == "code"), None)
    setup = setup_cell_source(project)
    if first_code is not None and (_tagged(cells[first_code], SETUP_TAG)
                                   or _source(cells[first_code]).startswith("# Setup")):
        cell = cells[first_code]
        cell["source"] = _lines(setup)
        cell["outputs"] = []  # in a clone the cell prints nothing, and nbval compares outputs
        tags = cell.setdefault("metadata", {}).setdefault("tags", [])
        if SETUP_TAG not in tags:
            tags.append(SETUP_TAG)
    else:  # no setup cell yet: put one before the first code cell (or at the end of an all-prose notebook)
        cells.insert(len(cells) if first_code is None else first_code, _new_cell(notebook, "code", SETUP_TAG, setup))
    notebook["cells"] = cells
    return json.dumps(notebook, indent=1, sort_keys=True, ensure_ascii=False) + "\n"  # as nbformat writes


def stamp_markdown(text: str, project: Project) -> str:
    """Replace what lies between `<!-- stamp:NAME -->` and `<!-- /stamp:NAME -->` markers."""
    parts = {"badges": f"\n{badges_markdown(project, None)}\n", "install": f"\n```bash\n{install_line(project)}\n```\n",
             "clone": f"\n```bash\n{clone_line(project)}\n```\n"}

    def replace(match):
        name = match.group(1)
        if name not in parts:
            raise SystemExit(f"unknown stamp marker <!-- stamp:{name} -->; known: {sorted(parts)}")
        return f"<!-- stamp:{name} -->{parts[name]}<!-- /stamp:{name} -->"

    return re.sub(r"<!-- stamp:(\w+) -->.*?<!-- /stamp:\1 -->", replace, text, flags=re.S)


def default_targets(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """README.md and every notebook under notebooks/ and assignments/ (checkpoints left out)."""
    targets = [root / "README.md"] if (root / "README.md").exists() else []
    for folder in NOTEBOOK_FOLDERS:
        targets += notebooks_in(root / folder)
    return targets


def notebooks_in(path: pathlib.Path) -> list[pathlib.Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)


def stamped(path: pathlib.Path, project: Project, root: pathlib.Path = ROOT) -> tuple[str, str]:
    """(current text, stamped text) of one file."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".ipynb":
        relpath = path.resolve().relative_to(root.resolve()).as_posix()
        return text, stamp_notebook(text, project, relpath)
    return text, stamp_markdown(text, project)


def out_of_step(paths, project: Project, root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """The files whose stamps differ from what `project` gives."""
    return [path for path in paths if len(set(stamped(path, project, root))) == 2]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=pathlib.Path,
                        help="notebooks or folders of notebooks (default: README.md, notebooks/, assignments/)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if anything is out of step")
    parser.add_argument("--root", type=pathlib.Path, default=ROOT, help=argparse.SUPPRESS)  # for the tests
    args = parser.parse_args(argv)
    root = args.root.resolve()
    project = read_project(root)
    paths = [p for given in args.paths for p in notebooks_in(given)] if args.paths else default_targets(root)
    if project.github is None:
        print(f"note: {project.address} is not on GitHub, and Colab opens notebooks from GitHub only: "
              "no Colab badges.", file=sys.stderr)
    changed = []
    for path in paths:
        old, new = stamped(path, project, root)
        if old != new:
            changed.append(path)
            if not args.check:
                path.write_text(new, encoding="utf-8")
    where = f"{project.pip_url} (ref {project.ref})"
    if args.check:
        for path in changed:
            print(f"out of step with {where}: {path}")
        if changed:
            print("run: python tools/stamp_notebooks.py")
        return 1 if changed else 0
    print(f"stamped {len(changed)} of {len(paths)} file(s) from {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
