"""The loopback platform's open-fd count, which ``assert_no_leaks`` compares with its mark."""

from __future__ import annotations

import os
from typing import Any

import pytest

from iop.testing import _platform


def test_an_fd_closed_while_counted_is_not_counted_and_the_count_stands(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A busy process closes fds between the listing of /proc/PID/fd and the
    # read of each link; once that made the whole count -1 (unknown), and
    # every later count a "leak" against that mark.
    real = os.readlink
    before = _platform._fds(os.getpid())
    gone = sorted(os.listdir(f"/proc/{os.getpid()}/fd"))[0]

    def readlink(path: Any, *args: Any, **kwargs: Any) -> str:
        if os.path.basename(str(path)) == gone:
            raise FileNotFoundError(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(_platform.os, "readlink", readlink)
    assert _platform._fds(os.getpid()) == before - 1


def test_a_process_that_is_gone_counts_as_unknown() -> None:
    assert _platform._fds(2**22 + 12345) == -1
