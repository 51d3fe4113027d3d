"""A sweep's trials as a table (the overrides that differ, final loss, tokens/s), and one figure
of every trial's loss curves.

    python scripts/sweep_report.py outputs/sweep-2026-12-01_05-30-33   # writes <sweep>/plots/

The trials: llmfoundry/launch/sweeps.py; the figures: llmfoundry/loggers/plot.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llmfoundry.launch.sweeps import trials
from llmfoundry.loggers.plot import plot_runs
from llmfoundry.utils.cli import add_script_arguments, script_errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=Path, help="the sweep folder (Hydra's sweep.dir)")
    parser.add_argument("--out", type=Path, help="folder for the figures (default <sweep>/plots)")
    parser.add_argument("--no-plot", action="store_true", help="print the table only")
    add_script_arguments(parser, storage=False)
    args = parser.parse_args(argv)
    with script_errors(args):
        return report(args)


def report(args: argparse.Namespace) -> int:
    found = trials(args.sweep)
    # Overrides every trial shares are the sweep's fixed settings; the rest are what it varied.
    common = set.intersection(*(set(t.overrides) for t in found))
    rows = [("TRIAL", "STATUS", "FINAL LOSS", "TOKENS/S", "OVERRIDES")]
    for trial in sorted(found, key=lambda t: (t.final_loss is None, t.final_loss or 0.0)):
        rows.append(
            (
                trial.name,
                trial.status,
                "-" if trial.final_loss is None else f"{trial.final_loss:.4f}",
                "-" if trial.tokens_per_sec is None else f"{trial.tokens_per_sec:,.0f}",
                " ".join(o for o in trial.overrides if o not in common),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    if not args.no_plot:
        plotted = {t.name: t.series for t in found if t.series}
        for path in plot_runs(plotted, args.out or args.sweep / "plots"):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
