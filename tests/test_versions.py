"""course_lib.check_torch: every notebook's setup cell says so when the runtime's PyTorch is older than 2.12."""

import torch

import course_lib
from course_lib import versions


def test_an_older_torch_gets_one_line_naming_both_versions_and_the_fix(capsys):
    assert course_lib.check_torch("2.11.0+cu130") is None  # the H100 image's build: notebooks 02 and 09 failed there
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "PyTorch 2.11.0+cu130" in err and "2.12 or newer" in err
    assert '%pip install -U "torch>=2.12"' in err and "restart the kernel" in err


def test_the_tested_versions_and_this_one_pass_silently(capsys):
    for version in ("2.12.1", "2.13.0", "2.14.1+cu128", "2.15.0a0+git1234", "3.0.0", torch.__version__):
        course_lib.check_torch(version)
    course_lib.check_torch()
    assert capsys.readouterr().err == ""


def test_the_floor_compares_as_numbers_not_text(capsys):
    assert versions._release("2.9.1") < versions.NOTEBOOKS_NEED_TORCH < versions._release("2.100.0")
    course_lib.check_torch("2.9.1")
    assert "PyTorch 2.9.1" in capsys.readouterr().err
