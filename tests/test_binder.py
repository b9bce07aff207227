"""Binder's configuration: what repo2docker reads, kept in step with requirements/course.txt.

repo2docker cannot run here (it needs a Docker engine), so these tests check the files against the
rules repo2docker follows (its conda build pack): which folder it reads, what it installs, in which
order; and the memory budget is measured by benchmarks/binder_memory.py, not here.
"""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(path: pathlib.Path) -> dict[str, str]:
    """name -> pinned version of a requirements file, following -r includes; `-e .` is left out."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-e"):
            continue
        if line.startswith("-r"):
            pins.update(_requirements(path.parent / line[2:].strip()))
            continue
        name, _, version = line.partition("==")
        assert version, f"{path.name}: {line!r} is not pinned with =="
        pins[_normal(name)] = version
    return pins


def _environment_yml() -> tuple[list[str], list[str]]:
    """(conda dependencies, pip lines) of environment.yml, read line by line (no YAML library in the test env)."""
    conda, pip, in_pip = [], [], False
    for raw in (ROOT / "environment.yml").read_text().splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        item = re.match(r"^(\s*)- (.*)$", line)
        if line.strip() == "- pip:":
            in_pip = True
        elif item and in_pip and len(item.group(1)) > 4:
            pip.append(item.group(2).strip())
        elif item:
            in_pip = False
            conda.append(item.group(2).strip())
    return conda, pip


def test_environment_yml_pins_exactly_what_requirements_course_txt_pins():
    conda, pip = _environment_yml()
    assert "python=3.11" in conda and "pip" in conda
    options = [line for line in pip if line.startswith("-")]
    assert options == ["--extra-index-url https://download.pytorch.org/whl/cpu"], "the CPU build of torch"
    pinned = {}
    for line in pip:
        if not line.startswith("-"):
            name, _, version = line.partition("==")
            pinned[_normal(name)] = version
    course = _requirements(ROOT / "requirements" / "course.txt")
    assert pinned == course, (f"environment.yml and requirements/course.txt differ: only in environment.yml "
                              f"{sorted(set(pinned.items()) - set(course.items()))}, only in course.txt "
                              f"{sorted(set(course.items()) - set(pinned.items()))}")


def test_the_pin_check_can_fail(tmp_path):
    (tmp_path / "base.txt").write_text("torch==2.13.0\n-e .\n")
    (tmp_path / "course.txt").write_text("-r base.txt\njupyterlab==4.6.6\n")
    assert _requirements(tmp_path / "course.txt") == {"torch": "2.13.0", "jupyterlab": "4.6.6"}
    (tmp_path / "course.txt").write_text("-r base.txt\njupyterlab>=4\n")
    with pytest.raises(AssertionError, match="not pinned"):
        _requirements(tmp_path / "course.txt")


def test_ipywidgets_and_jupyterlab_widgets_are_pinned_as_a_pair():
    """ipywidgets (kernel side) and jupyterlab_widgets (JupyterLab side) speak one protocol version:
    ipywidgets 8 needs jupyterlab_widgets 3, else JupyterLab shows "model not found"."""
    packaging_requirements = pytest.importorskip("packaging.requirements")
    course = _requirements(ROOT / "requirements" / "course.txt")
    ipywidgets, lab_widgets = course["ipywidgets"], course["jupyterlab-widgets"]
    assert ipywidgets.split(".")[0] == "8" and lab_widgets.split(".")[0] == "3"
    if importlib.metadata.version("ipywidgets") != ipywidgets:
        pytest.fail(f"the test environment has ipywidgets {importlib.metadata.version('ipywidgets')}, "
                    f"not the pinned {ipywidgets}: install requirements/test.txt")
    wanted = [packaging_requirements.Requirement(r) for r in importlib.metadata.requires("ipywidgets")]
    spec = next(r.specifier for r in wanted if _normal(r.name) == "jupyterlab-widgets" and r.marker is None)
    assert spec.contains(lab_widgets), f"ipywidgets {ipywidgets} wants jupyterlab_widgets{spec}, pinned {lab_widgets}"


def test_repo2docker_reads_the_root_files_and_installs_course_lib():
    # With a binder/ (or .binder/) folder, repo2docker reads only that folder: the root environment.yml
    # and postBuild would be ignored.
    assert not (ROOT / "binder").exists() and not (ROOT / ".binder").exists()
    # Its conda build installs environment.yml, never pyproject.toml: postBuild must, and fail loudly.
    post_build = ROOT / "postBuild"
    assert os.access(post_build, os.X_OK), "postBuild must be executable"
    commands = [line.strip() for line in post_build.read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert commands[0].startswith("set -e"), "a failed install must fail the Binder build"
    installs = [c for c in commands if re.search(r"\bpip install\b", c)]
    assert installs and all("--no-deps" in c and re.search(r"(--editable|-e)\s+\.$", c) for c in installs), installs
    # No local reference (-r, -e .) in environment.yml: repo2docker then installs it before copying the
    # repository in, and caches that step across changes to notebooks.
    _, pip = _environment_yml()
    assert not [line for line in pip if line.startswith(("-r", "-e", "--requirement", "--editable", "."))]


def test_binder_opens_every_notebook_folder_from_the_repository_root():
    """The assignment notebooks open on Binder too: they sit in folders of the repository, where the
    badges point, and import the course_lib that postBuild installed."""
    folders = [ROOT / "notebooks"] + ([ROOT / "assignments"] if (ROOT / "assignments").exists() else [])
    for folder in folders:
        notebooks = list(folder.rglob("*.ipynb"))
        assert notebooks, f"{folder.name}/ has no notebooks"
        for path in notebooks:
            relpath = path.relative_to(ROOT).as_posix()
            assert f"urlpath=lab%2Ftree%2F{relpath.replace('/', '%2F')}" in path.read_text(), relpath
