"""After torchrun exits 0: did the run finish, or stop early to be continued?

The trainer exits 0 both when it finishes and when it was preempted (it saved a checkpoint and
stopped; `llmfoundry/checkpoint/preemption.py`), so the exit status alone cannot tell a
scheduler whether to run the job again. The run's status file can
(`llmfoundry.callbacks.run_status`):

    python -m llmfoundry.launch.outcome <status file or URL> [--wait SECONDS]

exits 0 when the run finished, 75 (`RESUME_EXIT`) when it was preempted (the Slurm script
requeues the job, a Kubernetes pod restarts and resumes), and 1 otherwise. On nodes other than
the first, torchrun can return before rank 0 has recorded the end, so a ``running`` status is
re-read for up to ``--wait`` seconds.
"""

from __future__ import annotations

import argparse
import sys
import time

from llmfoundry.callbacks.run_status import read_status
from llmfoundry.launch.command import RESUME_EXIT


def outcome(path: str, wait_s: float = 0.0, poll_s: float = 1.0) -> int:
    deadline = time.monotonic() + wait_s
    while True:
        record = read_status(path)
        status = (record or {}).get("status")
        if status == "finished":
            return 0
        if status == "preempted":
            return RESUME_EXIT
        if status == "failed" or time.monotonic() >= deadline:
            print(f"run status at {path}: {status or 'missing'}", file=sys.stderr)
            return 1
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="the run's status.json (a path or fsspec URL)")
    parser.add_argument("--wait", type=float, default=0.0, help="seconds to wait for an end")
    args = parser.parse_args(argv)
    return outcome(args.path, args.wait)


if __name__ == "__main__":
    sys.exit(main())
