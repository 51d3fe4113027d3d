import io
import logging
import re
import sys

import pytest

from llmfoundry.loggers import ConsoleLogger, ProgressBarLogger
from tests.callbacks.conftest import make_trainer


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_non_tty_prints_plain_status_lines(tmp_path, capsys):
    trainer = make_trainer(tmp_path, n_batches=3, loggers=[ProgressBarLogger(non_tty_interval=0)])
    trainer.fit()
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert [line.split("|")[0].strip() for line in lines] == ["33%", "67%", "100%"]
    assert "3/3" in lines[-1] and "ba/s" in lines[-1]
    assert f"loss={trainer.state.train_loss:.4f}" in lines[-1]


def test_non_tty_is_quiet_between_intervals_but_reports_the_end(tmp_path, capsys):
    make_trainer(tmp_path, n_batches=3, loggers=[ProgressBarLogger(non_tty_interval=3600)]).fit()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("100%")


def test_tokens_total_is_extrapolated_when_max_duration_is_in_batches(tmp_path, capsys):
    # 3 batches of 4 x 16 = 64 tokens: 192 tokens in all, known only from the rate of progress.
    make_trainer(
        tmp_path, n_batches=3, loggers=[ProgressBarLogger(unit="tok", non_tty_interval=0)]
    ).fit()
    lines = capsys.readouterr().err.splitlines()
    assert re.search(r"\b64(\.0)?/192\b", lines[0]) and re.search(r"\b192/192\b", lines[-1])
    assert "tok/s" in lines[-1]


def test_terminal_gets_a_live_bar_in_the_max_duration_unit(tmp_path, monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    logger = ProgressBarLogger()
    make_trainer(tmp_path, n_batches=3, max_duration="192tok", loggers=[logger]).fit()
    out = terminal.getvalue()
    assert "\r" in out  # redrawn in place
    assert "192/192" in out and "loss=" in out


def test_bad_unit():
    with pytest.raises(ValueError, match="use ba, sp, tok"):
        ProgressBarLogger(unit="ep")


def test_console_prints_train_loss_and_metrics_every_interval(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="llmfoundry")
    trainer = make_trainer(tmp_path, n_batches=4, loggers=[ConsoleLogger(log_interval="2ba")])
    trainer.fit()
    lines = [line for line in caplog.messages if line.startswith("[batch")]
    assert [line.split("]")[0] for line in lines] == ["[batch 2", "[batch 4"]
    assert f"loss/train {trainer.state.train_loss:.4g}" in lines[-1]
