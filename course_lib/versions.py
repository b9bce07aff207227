"""Which PyTorch the notebooks need, and one line that says so when the runtime's is older.

The library's own requirement stays loose (``torch>=2.2`` in pyproject.toml) so that installing course_lib
never replaces the torch a Colab runtime or a cluster brings. The notebooks use two things that arrived
in PyTorch 2.12, and were found missing by running every notebook on torch 2.11.0+cu130 (on an H100, and
the same build here without a GPU):

* gloo's list form of ``dist.all_to_all`` (notebook 02 compares the hand-written all-to-all with it;
  torch 2.11 raises "Backend gloo does not support alltoall");
* ``torch.nn.parallel.distributed._BucketCapacityConfig`` (notebook 09 asks DDP's own bucket rule).

Every notebook runs on 2.13.0 in CI (requirements/base.txt, strict nbval) and ran on 2.12.1 and 2.14.1
(nbval --nbval-lax, once each, by hand); 2.15.0's source keeps ``_BucketCapacityConfig`` as 09 calls it.
"""

from __future__ import annotations

import re
import sys

import torch

NOTEBOOKS_NEED_TORCH = (2, 12)


def _release(version: str) -> tuple[int, int]:
    """(2, 11) from '2.11.0+cu130', '2.12.0a0+git1234' or '2.10'."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a PyTorch version: {version!r}")
    return int(match.group(1)), int(match.group(2))


def check_torch(version: str | None = None) -> None:
    """Say, in one line on stderr, if this PyTorch is older than the notebooks need; say nothing otherwise.

    Every notebook's setup cell calls it, so a learner on an older runtime reads why before a cell fails.

    Args:
        version: the version to judge (default: the running ``torch.__version__``).

    Example::

        >>> course_lib.check_torch("2.11.0")
        course_lib: this runtime has PyTorch 2.11.0; the notebooks need 2.12 or newer (...)
    """
    version = torch.__version__ if version is None else version
    if _release(version) >= NOTEBOOKS_NEED_TORCH:
        return
    need = ".".join(map(str, NOTEBOOKS_NEED_TORCH))
    print(f"course_lib: this runtime has PyTorch {version}; the notebooks need {need} or newer (notebook 02's "
          f"all_to_all on gloo and notebook 09's DDP bucket rule fail on older ones). Run "
          f"%pip install -U \"torch>={need}\" and restart the kernel.", file=sys.stderr)
