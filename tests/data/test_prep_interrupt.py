"""exit_on_interrupt: how every data_prep script ends on SIGTERM or Ctrl-C (in-process, fast)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from llmfoundry.data.prep.interrupt import exit_on_interrupt


def test_sigterm_runs_cleanup_then_exits_143(capsys):
    before = signal.getsignal(signal.SIGTERM)
    cleaned = []
    with pytest.raises(SystemExit) as stop, exit_on_interrupt():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)  # the handler raises here
            pytest.fail("SIGTERM did not interrupt the block")
        finally:
            cleaned.append(True)
    assert stop.value.code == 128 + signal.SIGTERM
    assert cleaned == [True]
    assert "interrupted (received SIGTERM)" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before


def test_ctrl_c_exits_130(capsys):
    with pytest.raises(SystemExit) as stop, exit_on_interrupt():
        raise KeyboardInterrupt
    assert stop.value.code == 128 + signal.SIGINT
    assert "interrupted (SIGINT)" in capsys.readouterr().err


def test_other_errors_pass_through():
    with pytest.raises(ValueError, match="bad"), exit_on_interrupt():
        raise ValueError("bad")
