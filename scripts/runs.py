"""List runs and follow their logs, from their status files (local folders or fsspec URLs).

    python scripts/runs.py                      # every run under outputs/
    python scripts/runs.py s3://bucket/runs     # or under a URL
    python scripts/runs.py logs NAME -f         # print a run's log and follow it while it runs

How status is known: llmfoundry/callbacks/run_status.py; the listing: llmfoundry/launch/monitor.py.
"""

from __future__ import annotations

import argparse
import sys

from llmfoundry.launch.monitor import STALE_S, find_run, find_runs, follow, log_file, table


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["logs"]:
        parser = argparse.ArgumentParser(prog="runs.py logs", description="print a run's log")
        parser.add_argument("name", help="run name (or its folder's name)")
        parser.add_argument("root", nargs="?", default="outputs", help="folder or URL of runs")
        parser.add_argument("-f", "--follow", action="store_true", help="follow while running")
        args = parser.parse_args(argv[1:])
        try:
            run = find_run(args.root, args.name)
            path = log_file(run)
        except (LookupError, FileNotFoundError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        status = f"{run.folder}/status.json" if args.follow else None
        for chunk in follow(path, status):
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default="outputs", help="folder or URL of runs")
    parser.add_argument(
        "--stale-after", type=float, default=STALE_S, help="seconds without heartbeat = failed"
    )
    args = parser.parse_args(argv)
    try:
        runs = find_runs(args.root, stale_s=args.stale_after)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(table(runs) if runs else f"no runs under {args.root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
