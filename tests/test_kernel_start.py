"""The test command's own guard (conftest.py): a notebook kernel that dies while it starts, because one of the ports
its manager picked was taken before it bound it, is started again, and the kernel's stderr says why."""

from __future__ import annotations

import socket

import pytest

nbval_kernel = pytest.importorskip("nbval.kernel")


def test_a_kernel_whose_port_was_taken_is_started_again_and_says_why(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    managers = []

    class FirstOneMeetsATakenPort(nbval_kernel.KernelManager):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            managers.append(self)
            if len(managers) == 1:
                self.cache_ports = False          # else jupyter_client picks its own ports at launch
                self.shell_port = taken.getsockname()[1]

    monkeypatch.setattr(nbval_kernel, "KernelManager", FirstOneMeetsATakenPort)
    try:
        with pytest.warns(UserWarning, match=r"(?s)died while it started \(start 1 of 3\).*Address already in use"):
            manager, client = nbval_kernel.start_new_kernel(kernel_name="python3")
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    finally:
        taken.close()
    assert len(managers) == 2


def test_a_kernel_that_always_dies_fails_with_its_own_stderr(monkeypatch):
    class Broken(nbval_kernel.KernelManager):
        def format_kernel_cmd(self, extra_arguments=None):
            return [super().format_kernel_cmd(extra_arguments)[0], "-c", "import sys; sys.exit('no kernel today')"]

    monkeypatch.setattr(nbval_kernel, "KernelManager", Broken)
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match=r"(?s)start 3 of 3.*no kernel today"):
        nbval_kernel.start_new_kernel(kernel_name="python3", startup_timeout=30)
