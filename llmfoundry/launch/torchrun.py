"""torchrun, without its report after a problem the user can fix.

A config or launch problem fails every rank alike: rank 0 prints it in one line and every rank
exits 2 (`llmfoundry.utils.errors.exit_on_user_error`). Plain torchrun then adds some 25 lines:
its agent logs each failed worker, and its ``ChildFailedError`` traceback ends in a box of
failures that says nothing the one line did not. This launcher is torchrun itself (its parser,
its ``main``, the same arguments and behaviour) except at the end: when every failed worker
exited 2 it adds nothing and exits 2; any other failure (a crash, a signal, a mix) keeps
torchrun's whole report, agent lines included, and its exit status.

    python scripts/torchrun.py --nproc_per_node=2 scripts/train.py strategy=ddp ...
    python -m llmfoundry.launch.torchrun ...   (the same; launch.py's job files run this)

torchrun's default of one OpenMP thread per worker (when it starts several per node and
OMP_NUM_THREADS is unset) still applies, without its four-line banner.
"""

from __future__ import annotations

import logging
import sys

from torch.distributed import run as torch_run
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from llmfoundry.utils.errors import EXIT_USAGE

__all__ = ["main"]

# The agent's lines about failed and stopped workers, logged as a run ends: held back until the
# failure is known to be a user error (dropped) or not (shown, before torchrun's report).
_AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"
_ENDING = ("failed (exitcode", "Sending process")
_BANNER = "OMP_NUM_THREADS"


class _HoldBack(logging.Filter):
    """Keeps the records whose message starts with one of `prefixes` instead of passing them."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(self.prefixes):
            self.held.append(record)
            return False
        return True


def _drop_banner(record: logging.LogRecord) -> bool:
    return not (isinstance(record.msg, str) and _BANNER in record.msg)


def user_error_only(err: ChildFailedError) -> bool:
    """Whether every failed worker exited with the user-error status (2)."""
    return bool(err.failures) and all(f.exitcode == EXIT_USAGE for f in err.failures.values())


def main(argv: list[str] | None = None) -> int:
    agent = logging.getLogger(_AGENT_LOGGER)
    ending = _HoldBack(_ENDING)
    agent.addFilter(ending)
    logging.getLogger(torch_run.__name__).addFilter(_drop_banner)
    try:
        torch_run.main(argv)
    except ChildFailedError as err:
        agent.removeFilter(ending)
        if user_error_only(err):
            return EXIT_USAGE  # rank 0 said it in one line
        for record in ending.held:
            agent.handle(record)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
