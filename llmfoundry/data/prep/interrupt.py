"""SIGTERM and SIGINT stop a data_prep step cleanly: workers stopped, temporary output removed.

By default SIGTERM kills a Python process on the spot: no ``finally`` block runs, so temporary
files stay behind and a process pool's workers are orphaned (still running, holding gigabytes).
Inside :func:`stop_on_signals` SIGTERM instead raises :class:`Terminated` in the main thread, as
Ctrl-C raises ``KeyboardInterrupt``, so the usual cleanup paths run: ``atomic_path`` removes its
temporary file, ``MDSWriter`` aborts (removing its shards), and the tokenizer pool terminates its
workers. :func:`exit_on_interrupt` then prints one line and exits with status 128 + the signal
number, as a shell reports it; :func:`prep_script` is what every data_prep script runs its work in.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType

from llmfoundry.utils.cli import script_errors

__all__ = ["Terminated", "exit_on_interrupt", "prep_script", "stop_on_signals"]


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived. A KeyboardInterrupt, so ``except Exception`` never swallows it."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"received {signal.Signals(signum).name}")


def _raise(signum: int, frame: FrameType | None) -> None:
    del frame
    signal.signal(signum, signal.SIG_IGN)  # a repeated SIGTERM must not cut the cleanup short
    raise Terminated(signum)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` (main thread only; elsewhere no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def exit_on_interrupt() -> Iterator[None]:
    """Run the block under :func:`stop_on_signals`; SIGTERM or Ctrl-C then exits 128 + signum."""
    try:
        with stop_on_signals():
            yield
    except KeyboardInterrupt as err:  # SIGINT, or SIGTERM (Terminated)
        sys.stderr.write(
            f"interrupted ({str(err) or 'SIGINT'}): stopped, temporary output removed\n"
        )
        raise SystemExit(128 + getattr(err, "signum", signal.SIGINT)) from None


@contextlib.contextmanager
def prep_script(args: argparse.Namespace) -> Iterator[None]:
    """A data_prep script's work: ``--storage`` applied, user errors one line (exit 2), SIGTERM
    and Ctrl-C cleaned up (exit 128 + signum)."""
    with script_errors(args), exit_on_interrupt():
        yield
