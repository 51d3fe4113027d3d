"""Logging set up once per process, so every rank speaks once and the run folder keeps it all.

Library modules log through ``logging.getLogger(__name__)`` and never check ranks themselves.
:func:`configure_logging` (called by ``scripts/train.py`` and the ``data_prep`` scripts) sends
INFO lines to stdout (the console logger's metric lines among them), warnings and errors to
stderr, and everything to an optional file (the run folder's ``train.log``). Rank 0 logs everything as plain lines; other ranks log
only warnings and errors, prefixed ``[rank N]`` so lines of different processes tell apart;
a warning every rank would give alike (about the data or the config, which all ranks share) is
logged with ``extra=SAME_ON_EVERY_RANK`` and shown by rank 0 only. The progress bar writes to
stderr itself and stays out of the file.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from llmfoundry.utils.secrets import redact_urls

__all__ = ["SAME_ON_EVERY_RANK", "RankFilter", "configure_logging"]

_HANDLER_NAME = "llmfoundry"
_OURS = ("llmfoundry", "__main__")  # loggers shown at ``level``; the scripts log as __main__
# `log.warning(..., extra=SAME_ON_EVERY_RANK)`: a warning that 8 ranks would repeat 8 times.
SAME_ON_EVERY_RANK = {"same_on_every_rank": True}


class RankFilter(logging.Filter):
    """Passes every record on rank 0; on other ranks only warnings and errors, rank-prefixed,
    except those marked `SAME_ON_EVERY_RANK`."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        level = f"{record.levelname.lower()}: " if record.levelno >= logging.WARNING else ""
        record.prefix = (f"[rank {self.rank}] " if self.rank else "") + level
        if self.rank == 0:
            return True
        return record.levelno >= logging.WARNING and not getattr(
            record, "same_on_every_rank", False
        )


class _RedactingFormatter(logging.Formatter):
    """Hides the user-info of URLs (``s3://user:password@host``) in every line we log."""

    def format(self, record: logging.LogRecord) -> str:
        return redact_urls(super().format(record))


def configure_logging(
    log_file: str | os.PathLike | None = None,
    rank: int | None = None,
    level: int = logging.INFO,
) -> None:
    """Send log records to stdout (INFO), stderr (warnings, errors) and ``log_file``, by rank.

    ``llmfoundry`` loggers (and the scripts') log from ``level`` up, other libraries from
    WARNING.

    ``rank`` defaults to the ``RANK`` environment variable torchrun sets (0 when absent).
    Calling it again replaces the handlers it added before (e.g. a second run in one process).
    """
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    root = logging.getLogger()
    for handler in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(handler)
        handler.close()
    stdout, stderr = logging.StreamHandler(sys.stdout), logging.StreamHandler(sys.stderr)
    stdout.addFilter(lambda record: record.levelno < logging.WARNING)
    stderr.setLevel(logging.WARNING)
    handlers: list[logging.Handler] = [stdout, stderr]
    if log_file is not None:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file, mode="a", encoding="utf-8"))
    for handler in handlers:
        handler.set_name(_HANDLER_NAME)
        handler.addFilter(RankFilter(rank))
        handler.setFormatter(_RedactingFormatter("%(prefix)s%(message)s"))
        root.addHandler(handler)
    root.setLevel(logging.WARNING)  # other libraries: warnings and errors only
    for name in _OURS:
        logging.getLogger(name).setLevel(level)
