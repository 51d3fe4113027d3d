"""After torchrun exits: did the run finish, stop early to be continued, or fail?

Neither exit status tells a scheduler whether to run the job again: the trainer exits 0 both
when it finishes and when it was preempted (it saved a checkpoint and stopped;
`llmfoundry/checkpoint/preemption.py`), and torchrun's agent exits non-zero when the scheduler's
SIGTERM reaches it too, even though its workers saved and stopped cleanly. The run's status
file knows (`llmfoundry.callbacks.run_status`):

    python -m llmfoundry.launch.outcome <status file or URL> [--wait S] [--exit-code N]

exits 0 when the run finished, 75 (`RESUME_EXIT`) when it was preempted (the Slurm script
requeues the job, a Kubernetes pod restarts and resumes), and otherwise torchrun's exit status
(``--exit-code``; at least 1). On nodes other than the first, torchrun can return before rank 0
has recorded the end, so a ``running`` status is re-read for up to ``--wait`` seconds.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from llmfoundry.launch.command import RESUME_EXIT
from llmfoundry.utils.status_file import read_status

log = logging.getLogger(__name__)


def outcome(path: str, wait_s: float = 0.0, exit_code: int = 1, poll_s: float = 1.0) -> int:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            record = read_status(path)
        except ValueError as err:  # not a status file (`read_status`): the run's end is unknown
            log.warning("%s", err)
            record = None
        status = (record or {}).get("status")
        if status == "finished":
            return 0
        if status == "preempted":
            return RESUME_EXIT
        if status != "running" or time.monotonic() >= deadline:
            log.warning("run status at %s: %s", path, status or "missing")
            return exit_code if exit_code not in (0, RESUME_EXIT) else 1
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="the run's status.json (a path or fsspec URL)")
    parser.add_argument("--wait", type=float, default=0.0, help="seconds to wait for an end")
    parser.add_argument("--exit-code", type=int, default=1, help="torchrun's exit status")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return outcome(args.path, args.wait, args.exit_code)


if __name__ == "__main__":
    sys.exit(main())
