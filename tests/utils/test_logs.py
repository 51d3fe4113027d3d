"""Logging configured once: rank 0 speaks, other ranks only warn, and a file keeps it all.

tests/conftest.py removes the handlers these tests add."""

import logging

from llmfoundry.utils.logs import SAME_ON_EVERY_RANK, configure_logging

log = logging.getLogger("llmfoundry.tests")


def test_rank0_logs_info_to_stdout_and_file(tmp_path, capsys):
    configure_logging(tmp_path / "run" / "train.log", rank=0)
    log.info("[batch 2] loss/train 3.1")
    log.warning("loss spike")
    logging.getLogger("botocore").info("library chatter")
    captured = capsys.readouterr()
    assert captured.out == "[batch 2] loss/train 3.1\n"
    assert captured.err == "warning: loss spike\n"
    assert (tmp_path / "run" / "train.log").read_text() == captured.out + captured.err


def test_other_ranks_log_only_warnings_with_their_rank(tmp_path, capsys):
    configure_logging(tmp_path / "train.log", rank=3)
    log.info("[batch 2] loss/train 3.1")
    log.error("checkpoint has no RNG state")
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == "[rank 3] error: checkpoint has no RNG state\n"
    assert (tmp_path / "train.log").read_text() == captured.err


def test_configuring_again_replaces_the_handlers(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    configure_logging(tmp_path / "a.log")
    configure_logging(tmp_path / "b.log")
    log.info("once")
    assert capsys.readouterr().out == "once\n"
    assert (tmp_path / "a.log").read_text() == ""
    assert (tmp_path / "b.log").read_text() == "once\n"


def test_a_warning_alike_on_every_rank_is_shown_once(tmp_path, capsys):
    """Data and config warnings (the data's vocabulary, a skipped callback) are the same on
    every rank: rank 0 says them, the others do not repeat them."""
    for rank in (0, 1):
        configure_logging(tmp_path / f"{rank}.log", rank=rank)
        log.warning("model.vocab_size=128 is larger", extra=SAME_ON_EVERY_RANK)
        log.warning("rank's own problem")
    assert capsys.readouterr().err == (
        "warning: model.vocab_size=128 is larger\nwarning: rank's own problem\n"
        "[rank 1] warning: rank's own problem\n"
    )
