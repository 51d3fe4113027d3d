"""List runs and follow their logs, from their status files (local folders or fsspec URLs).

    python scripts/runs.py                      # every run under outputs/
    python scripts/runs.py s3://bucket/outputs  # or under a URL (the runs' outputs=)
    python scripts/runs.py s3://bucket/outputs --storage '{options: {endpoint_url: http://localhost:9000}}'
    python scripts/runs.py logs NAME -f         # print a run's log and follow it while it runs
    python scripts/runs.py describe NAME        # status, backend and job id, config, last metrics
    python scripts/runs.py stop NAME [--yes]    # checkpoint and stop: local, Slurm or Kubernetes

Each run's checkpoints are read with the storage settings the run saved (its config's storage:
block); --storage (the same block) is for the root URL and wins over what runs saved. A run
that cannot be read is listed as unreadable, with the reason.
How status is known: llmfoundry/callbacks/run_status.py; the listing: llmfoundry/launch/monitor.py;
describe and stop: llmfoundry/launch/control.py.
"""

from __future__ import annotations

import argparse
import sys

from llmfoundry.launch.control import describe, stop, stop_target
from llmfoundry.launch.monitor import (
    STALE_S,
    find_run,
    find_runs,
    follow,
    log_file,
    save_folders_without_runs,
    table,
)
from llmfoundry.utils.cli import add_script_arguments, script_errors
from llmfoundry.utils.errors import UserError

# The commands acting on one run, and what each does.
RUN_COMMANDS = {
    "logs": "print a run's log",
    "describe": "a run's status, backend and job id, folder, config and last metrics",
    "stop": "ask a running run to checkpoint and stop (local, Slurm or Kubernetes)",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in RUN_COMMANDS:
        command = argv[0]
        parser = argparse.ArgumentParser(
            prog=f"runs.py {command}", description=RUN_COMMANDS[command]
        )
        parser.add_argument("name", help="run name (or its folder's name)")
        parser.add_argument("root", nargs="?", default="outputs", help="folder or URL of runs")
        if command == "logs":
            parser.add_argument("-f", "--follow", action="store_true", help="follow while running")
        if command == "stop":
            parser.add_argument("-y", "--yes", action="store_true", help="do not ask to confirm")
        add_script_arguments(parser)
        args = parser.parse_args(argv[1:])
        with script_errors(args):
            if command == "describe":
                print(describe(find_run(args.root, args.name)))
                return 0
            return logs(args) if command == "logs" else stop_run(args)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default="outputs", help="folder or URL of runs")
    parser.add_argument(
        "--stale-after", type=float, default=STALE_S, help="seconds without heartbeat = failed"
    )
    add_script_arguments(parser)
    args = parser.parse_args(argv)
    with script_errors(args):
        runs = find_runs(args.root, stale_s=args.stale_after)
        print(table(runs) if runs else no_runs(args.root))
    return 0


def no_runs(root: str) -> str:
    """What to say when `root` holds no run: a root of save folders is a common mistake."""
    folders = save_folders_without_runs(root)
    if not folders:
        return f"no runs under {root}"
    return (
        f"no runs under {root}, but checkpoints in {', '.join(folders[:3])}"
        f"{' ...' if len(folders) > 3 else ''}: a save folder holds checkpoints only; list the "
        "runs' outputs folder instead (outputs/ by default, or the URL the run's outputs= named)"
    )


def stop_run(args: argparse.Namespace) -> int:
    run = find_run(args.root, args.name)
    backend, target = stop_target(run)
    what = {"local": f"process {target}", "slurm": f"Slurm job {target}"}.get(
        backend, f"Kubernetes job {target}"
    )
    if not args.yes:
        if not sys.stdin.isatty():
            raise UserError(f"stop {run.name} ({what}): confirm with --yes (no terminal to ask)")
        answer = input(f"stop run {run.name} ({what}, status {run.status})? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("not stopped")
            return 1
    print(stop(backend, target))
    return 0


def logs(args: argparse.Namespace) -> int:
    run = find_run(args.root, args.name)
    path = log_file(run)
    status = f"{run.folder}/status.json" if args.follow else None
    for chunk in follow(path, status):
        sys.stdout.buffer.write(chunk)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
