"""Problems a user caused and can fix, reported by the command-line scripts as one line.

A wrong config value, a missing data folder, ``strategy=ddp`` without torchrun: a traceback
through the trainer's internals only hides the one sentence that matters. Library code raises
:class:`UserError` (or a subclass: :class:`MissingInput` for a path that is not there,
:class:`OutputExists`, :class:`MissingPackage`) with a message that names the problem, the path
or key, and the fix; every script (scripts/, data_prep/) runs under :func:`exit_on_user_error`,
which prints that message on one line (under torchrun: once, by rank 0, when every rank fails
alike) and exits with status 2, as config errors do. ``--debug``
on the command line, or ``LLMFOUNDRY_DEBUG=1`` in the environment, lets the exception through
with its traceback. Bugs (any other exception) always keep their traceback. A full disk, a quota,
a read-only or forbidden path (`OSError` with one of `_ENVIRONMENT_FIXES`' error numbers) is the
machine's state, not a bug, and is reported the same way with the path it concerns.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence

from llmfoundry.utils.secrets import redact_urls

__all__ = [
    "DEBUG_ENV",
    "DEBUG_FLAG",
    "MissingInput",
    "MissingPackage",
    "OutputExists",
    "UserError",
    "exit_on_user_error",
    "find_user_error",
    "printable",
    "split_debug_flag",
]

DEBUG_FLAG = "--debug"
DEBUG_ENV = "LLMFOUNDRY_DEBUG"
EXIT_USAGE = 2  # as argparse and the config check use
# How long a torchrun rank other than 0 waits before printing its user error: torchrun stops it
# within a second of rank 0's exit (its monitor polls every 0.1 s) if rank 0 failed too.
PEER_GRACE_S = 5.0
# OSErrors that say what to fix on the machine, and the fix.
_ENVIRONMENT_FIXES = {
    errno.ENOSPC: "free space there or point the run at another folder",
    errno.EDQUOT: "free space within the quota or point the run at another folder",
    errno.EROFS: "the filesystem is read-only; point the run at a writable folder",
    errno.EACCES: "give this user access or point the run at another folder",
}


class UserError(ValueError):
    """A problem with what the user gave (a value, a file, a launch), with its fix in the text."""


class MissingInput(UserError, FileNotFoundError):
    """An input path or URL that does not exist (still a FileNotFoundError for callers)."""


class OutputExists(UserError, FileExistsError):
    """An output that is already there and is not overwritten (still a FileExistsError)."""


class MissingPackage(UserError, ImportError):
    """An optional package a feature needs and that is not installed (still an ImportError)."""


def printable(text: str) -> str:
    """`text` with what a terminal would act on rather than show (escape sequences, carriage
    returns, bidirectional overrides: any non-printable character) written as its Python escape,
    for text read from files others write (a run's name or error in its status file)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def split_debug_flag(argv: Sequence[str]) -> tuple[list[str], bool]:
    """``argv`` without ``--debug``, and whether tracebacks were asked for (flag or env)."""
    rest = [arg for arg in argv if arg != DEBUG_FLAG]
    debug = len(rest) != len(argv) or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    return rest, debug


def find_user_error(
    err: BaseException, also: tuple[type[BaseException], ...] = ()
) -> BaseException | None:
    """The user error ``err`` is or wraps (Hydra's instantiate re-raises with ``from``), if any."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, (UserError, *also)):
            return current
        if isinstance(current, OSError) and current.errno in _ENVIRONMENT_FIXES:
            where = f": {current.filename}" if current.filename else ""
            return UserError(f"{current.strerror}{where}; {_ENVIRONMENT_FIXES[current.errno]}")
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


@contextlib.contextmanager
def exit_on_user_error(
    debug: bool, prefix: str = "error", also: tuple[type[BaseException], ...] = ()
) -> Iterator[None]:
    """Turn a :class:`UserError` (and the ``also`` types) into one stderr line and exit 2.

    ``prefix`` starts the line (the script's name, say). With ``debug`` the exception propagates
    unchanged, traceback included. ``also`` takes a third-party library's own error types only:
    a built-in one (ValueError, FileNotFoundError, LookupError, ...) is what a bug raises too,
    so catching it would print a bug as one line and hide its traceback; the code that knows the
    cause raises :class:`UserError` instead.
    """
    broad = [t.__name__ for t in also if t.__module__ == "builtins"]
    if broad:
        raise TypeError(
            f"exit_on_user_error(also=...) takes third-party error types, not {broad}: raise "
            "UserError (or MissingInput, OutputExists, MissingPackage) where the cause is known"
        )
    try:
        yield
    except Exception as err:
        found = find_user_error(err, also)
        if debug or found is None:
            raise
        message = printable(redact_urls(" ".join(str(found).split()))) or type(found).__name__
        rank = os.environ.get("RANK", "0")  # torchrun's
        if rank != "0":
            _wait_for_rank_0()
            prefix = f"{prefix} (rank {rank})"
        sys.stderr.write(f"{prefix}: {message}\n")
        sys.stderr.flush()
        raise SystemExit(EXIT_USAGE) from None


def _wait_for_rank_0() -> None:
    """Under torchrun a config or launch problem fails every rank alike: rank 0 prints it, once,
    and torchrun then stops the other ranks (SIGTERM: exit 2 here, silently). A rank whose error
    rank 0 did not share is still stopped after `PEER_GRACE_S` and prints its own line."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: os._exit(EXIT_USAGE))
    time.sleep(PEER_GRACE_S)
