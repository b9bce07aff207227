"""The repository's one address (pyproject.toml [project.urls]) and everything stamped from it.

tools/stamp_notebooks.py writes the Colab and Binder badges and the install line of every notebook and
of README.md from that address. These tests fail when a notebook is out of step with it, when a notebook
would install anything by bare name from the package index, or when the stamper stops being mechanical
(touching other cells, or changing something on a second run).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "stamp_notebooks.py"

if "stamp_notebooks" not in sys.modules:  # tools/ is not a package: load the stamper from its file
    _spec = importlib.util.spec_from_file_location("stamp_notebooks", TOOL)
    sys.modules["stamp_notebooks"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["stamp_notebooks"])
stamp = sys.modules["stamp_notebooks"]


def _notebooks():
    return [p for p in stamp.default_targets(ROOT) if p.suffix == ".ipynb"]


def _code_cells(path):
    return [("".join(c["source"]), c) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def _fake_repository(tmp_path, address="https://github.com/course-lib/course_lib", version="0.1.0.dev0"):
    """pyproject.toml, README.md and two notebooks (one in a nested assignments folder) in a temporary root."""
    text = (ROOT / "pyproject.toml").read_text()
    text = re.sub(r'(?m)^Repository = ".*"$', f'Repository = "{address}"', text)
    text = re.sub(r'(?m)^version = ".*"$', f'version = "{version}"', text)
    (tmp_path / "pyproject.toml").write_text(text)
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    (tmp_path / "notebooks").mkdir(exist_ok=True)
    shutil.copy(ROOT / "notebooks" / "00_hello_ranks.ipynb", tmp_path / "notebooks")
    (tmp_path / "assignments" / "week1").mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "notebooks" / "04_ring_scatter_reduce.ipynb", tmp_path / "assignments" / "week1" / "a.ipynb")
    return tmp_path


def _run_tool(root, *args):
    return subprocess.run([sys.executable, str(TOOL), "--root", str(root), *args], capture_output=True, text=True)


# --------------------------------------------------------------------------------------------------
# the repository as committed
# --------------------------------------------------------------------------------------------------


def test_every_notebook_and_the_readme_are_in_step_with_the_address():
    project = stamp.read_project(ROOT)
    targets = stamp.default_targets(ROOT)
    assert ROOT / "README.md" in targets and len(_notebooks()) >= 11
    stale = stamp.out_of_step(targets, project, ROOT)
    assert stale == [], (f"out of step with {project.pip_url}: {[str(p.relative_to(ROOT)) for p in stale]}. "
                         "Run: python tools/stamp_notebooks.py")


def test_the_check_command_agrees():
    run = _run_tool(ROOT, "--check")
    assert run.returncode == 0, run.stdout + run.stderr


def test_every_notebook_opens_with_badges_and_a_setup_cell_from_the_address():
    project = stamp.read_project(ROOT)
    for path in _notebooks():
        relpath = path.relative_to(ROOT).as_posix()
        cells = json.loads(path.read_text())["cells"]
        badges = "".join(cells[0]["source"])
        assert f"https://colab.research.google.com/github/course-lib/course_lib/blob/{project.ref}/{relpath}" in badges
        assert f"https://mybinder.org/v2/gh/course-lib/course_lib/{project.ref}?urlpath=lab%2Ftree%2F" in badges
        setup, _ = _code_cells(path)[0]
        assert f'os.environ.get("COURSE_LIB_SOURCE", "{project.pip_url}")' in setup, relpath
        assert '%pip install -q "course_lib @ {COURSE_LIB_SOURCE}"' in setup, relpath
    readme = (ROOT / "README.md").read_text()
    assert stamp.badges_markdown(project, None) in readme.split("\n\n")[1]  # right under the title
    assert stamp.install_line(project) in readme


def test_the_version_is_written_once_in_the_package_and_in_pyproject():
    import course_lib

    assert course_lib.__version__ == stamp.read_project(ROOT).version


def _pip_installs(source: str):
    """(line, requirements) for every `pip install` in a cell (%pip, !pip, python -m pip, subprocess lists).

    "name @ url" counts as one requirement, however it is quoted.
    """
    for line in source.splitlines():
        match = re.search(r"pip['\"]?,?\s+['\"]?install\b(.*)", line)
        if not match:
            continue
        words = [w for w in re.findall(r"[^\s'\",\[\]()]+", match.group(1)) if not w.startswith("-")]
        requirements = []
        while words:
            if len(words) >= 3 and words[1] == "@":
                requirements.append(" ".join(words[:3]))
                words = words[3:]
            else:
                requirements.append(words.pop(0))
        yield line, requirements


def test_no_notebook_installs_anything_by_bare_name():
    """A bare name asks the package index, where anyone can publish a package called course_lib."""
    found = []
    for path in _notebooks():
        for source, _ in _code_cells(path):
            for line, requirements in _pip_installs(source):
                for requirement in requirements:
                    direct = "@" in requirement or requirement.startswith(("git+", "./", "/", "file:"))
                    if not direct:
                        found.append(f"{path.relative_to(ROOT)}: {line.strip()!r} installs {requirement!r}")
    assert found == []


def test_the_bare_name_check_can_fail():
    cell = ('%pip install -q course_lib\nsubprocess.run(["pip", "install", "numpy"])\n'
            '%pip install -q "course_lib @ {COURSE_LIB_SOURCE}" x\n!pip install --upgrade git+https://h/o/r')
    assert [r for _, r in _pip_installs(cell)] == [["course_lib"], ["numpy"], ["course_lib @ {COURSE_LIB_SOURCE}", "x"],
                                                   ["git+https://h/o/r"]]


# --------------------------------------------------------------------------------------------------
# the stamper itself, on a temporary copy
# --------------------------------------------------------------------------------------------------


def test_changing_the_address_restamps_everything_and_only_the_stamped_cells(tmp_path):
    root = _fake_repository(tmp_path)
    _run_tool(root)  # the copy in assignments/ needs badges for where it now lies
    assert _run_tool(root, "--check").returncode == 0
    before = {p: json.loads(p.read_text()) for p in root.rglob("*.ipynb")}

    _fake_repository(tmp_path, address="https://github.com/someone/their_fork")
    check = _run_tool(root, "--check")
    assert check.returncode == 1 and check.stdout.count("out of step") == 3, check.stdout  # README + 2 notebooks
    assert _run_tool(root).returncode == 0
    for path in [root / "README.md", *before]:
        text = path.read_text()
        assert "course-lib/course_lib" not in text, path
        assert "someone/their_fork" in text
    assert 'pip install "course_lib @ git+https://github.com/someone/their_fork"' in (root / "README.md").read_text()
    for path, old in before.items():
        new = json.loads(path.read_text())
        assert len(new["cells"]) == len(old["cells"])
        for a, b in zip(old["cells"][1:], new["cells"][1:]):
            if "setup" not in a.get("metadata", {}).get("tags", []):
                assert a == b, f"{path.name}: a cell that is not stamped changed"
    assert "blob/main/assignments/week1/a.ipynb" in (root / "assignments" / "week1" / "a.ipynb").read_text()


def test_stamping_twice_changes_nothing(tmp_path):
    root = _fake_repository(tmp_path, address="https://github.com/someone/their_fork")
    _run_tool(root)
    first = {p: p.read_bytes() for p in [root / "README.md", *root.rglob("*.ipynb")]}
    assert _run_tool(root).stdout.startswith("stamped 0 of 3")
    assert {p: p.read_bytes() for p in first} == first


def test_a_release_version_pins_the_tag_and_a_development_version_follows_the_branch(tmp_path):
    (tmp_path / "r").mkdir()
    release = stamp.read_project(_fake_repository(tmp_path / "r", version="0.2.0"))
    assert release.ref == "v0.2.0" and release.pip_url == "git+https://github.com/course-lib/course_lib@v0.2.0"
    assert "blob/v0.2.0/notebooks/x.ipynb" in stamp.colab_url(release, "notebooks/x.ipynb")
    assert stamp.binder_url(release, "notebooks/x.ipynb").startswith(
        "https://mybinder.org/v2/gh/course-lib/course_lib/v0.2.0?urlpath=lab%2Ftree%2Fnotebooks%2Fx.ipynb")
    (tmp_path / "d").mkdir()
    dev = stamp.read_project(_fake_repository(tmp_path / "d", version="0.2.0.dev3"))
    assert dev.ref == "main" and dev.pip_url == "git+https://github.com/course-lib/course_lib"


def test_a_notebook_without_a_setup_cell_gets_one_before_its_first_code_cell(tmp_path):
    notebook = {"cells": [{"cell_type": "markdown", "id": "t", "metadata": {}, "source": ["# Title"]},
                          {"cell_type": "code", "id": "c", "metadata": {}, "execution_count": None, "outputs": [],
                           "source": ["x = 1"]}],
                "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    project = stamp.read_project(ROOT)
    once = stamp.stamp_notebook(json.dumps(notebook), project, "assignments/x.ipynb")
    cells = json.loads(once)["cells"]
    assert [c.get("metadata", {}).get("tags") for c in cells] == [["badges"], None, ["setup"], None]
    assert "".join(cells[3]["source"]) == "x = 1"
    assert stamp.stamp_notebook(once, project, "assignments/x.ipynb") == once
    nbformat = pytest.importorskip("nbformat")
    nbformat.validate(nbformat.reads(once, as_version=4))


def test_an_address_off_github_gets_binder_but_no_colab_badge(tmp_path):
    root = _fake_repository(tmp_path, address="https://gitlab.com/someone/course_lib")
    run = _run_tool(root)
    assert run.returncode == 0 and "Colab opens notebooks from GitHub only" in run.stderr
    text = (root / "notebooks" / "00_hello_ranks.ipynb").read_text()
    assert "colab.research.google.com" not in text
    assert "https://mybinder.org/v2/git/https%3A%2F%2Fgitlab.com%2Fsomeone%2Fcourse_lib/main" in text


# --------------------------------------------------------------------------------------------------
# the setup cell itself, run outside IPython (its %pip line stubbed) in an interpreter without site-packages
# --------------------------------------------------------------------------------------------------

_STUB = """
import sys
class _Shell:
    def run_line_magic(self, name, line):  # IPython expands {name} from the caller's variables first
        print("MAGIC", name, line.format_map(sys._getframe(1).f_globals), flush=True)
def get_ipython():
    return _Shell()
"""


def _run_setup_cell(cwd, env=None):
    """Run the stamped setup cell with `cwd` as the notebook's folder; (stdout, stderr, returncode)."""
    transformer = pytest.importorskip("IPython.core.inputtransformer2").TransformerManager()
    code = transformer.transform_cell(stamp.setup_cell_source(stamp.read_project(ROOT)))
    assert "run_line_magic('pip'" in code
    program = _STUB + code + "\nprint('IMPORTED', course_lib.__file__)\n"
    clean = {"PATH": "/usr/bin:/bin", **(env or {})}
    run = subprocess.run([sys.executable, "-I", "-S", "-c", program], cwd=cwd, capture_output=True, text=True,
                         env=clean, timeout=60)
    return run.stdout, run.stderr, run.returncode


def test_the_setup_cell_imports_the_clone_it_sits_in_at_any_depth(tmp_path):
    (tmp_path / "course_lib").mkdir()
    (tmp_path / "course_lib" / "__init__.py").write_text("def check_torch():\n    print('CHECKED')\n")
    folder = tmp_path / "assignments" / "week1"
    folder.mkdir(parents=True)
    out, err, code = _run_setup_cell(folder)
    assert code == 0, err
    assert "MAGIC" not in out and f"IMPORTED {tmp_path / 'course_lib' / '__init__.py'}" in out
    assert "CHECKED" in out  # the setup cell asks the imported course_lib whether this PyTorch is new enough


def test_the_setup_cell_installs_from_the_address_outside_a_clone(tmp_path):
    project = stamp.read_project(ROOT)
    out, err, code = _run_setup_cell(tmp_path)
    assert f'MAGIC pip install -q "course_lib @ {project.pip_url}"' in out
    assert code != 0 and "ModuleNotFoundError" in err  # the stub installed nothing: the cell says so at once
    out, _, _ = _run_setup_cell(tmp_path, env={"COURSE_LIB_SOURCE": "git+file://localhost/somewhere@v9"})
    assert 'MAGIC pip install -q "course_lib @ git+file://localhost/somewhere@v9"' in out
