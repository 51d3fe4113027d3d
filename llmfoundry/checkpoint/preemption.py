"""Preemption: SIGTERM or SIGINT asks the run to checkpoint after the current batch and stop.

Schedulers (SLURM, Kubernetes, spot instances) send SIGTERM some time before killing a job; a
user sends SIGINT with Ctrl-C. Either one is recorded here and acted on by the trainer at the
next batch end: the checkpoint saver saves, the run stops without final evaluation and exits
normally (status 0), and rerunning the same command with ``autoresume=true`` continues. A second
signal gets the previous handler (for SIGINT: KeyboardInterrupt at once), unless it comes within
`REPEAT_WINDOW_S` of the first: one Ctrl-C reaches a process twice under torchrun (from the
terminal, to the whole process group, and forwarded by torchrun's agent), and must not abort
the save it asked for.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)
REPEAT_WINDOW_S = 2.0


class Preemption:
    """Context manager installing the handlers; `signal` is the first signal received, if any.

    Handlers can only be installed from the main thread; elsewhere the signals keep their
    current behaviour, as do signals this process was started ignoring.
    """

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None
        self._previous: dict[int, Any] = {}
        self._first_at = 0.0

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                # A signal ignored by whoever started us (a shell runs background jobs with
                # SIGINT ignored) stays ignored: then nothing is promised that would not happen.
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._restore()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is not None:  # a repeat, within the window (see the module docstring)
            if time.monotonic() - self._first_at < REPEAT_WINDOW_S:
                return
            previous = self._previous.get(signum)
            self._restore()
            if callable(previous):
                previous(signum, frame)
            else:
                os.kill(os.getpid(), signum)  # the default action, now restored
            return
        self.signal = signal.Signals(signum)
        self._first_at = time.monotonic()
        log.info(  # once, from rank 0: every rank gets the signal
            "received %s: saving a checkpoint after the current batch, then stopping (send it "
            "again to stop at once)",
            self.signal.name,
        )

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            # None: a handler installed outside Python, which cannot be reinstalled from here.
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()
