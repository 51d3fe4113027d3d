"""Plot loss, learning rate and throughput curves of one or more runs into PNG files.

    python scripts/plot.py outputs/run-2024-05-01_10-00-00
    python scripts/plot.py outputs/baseline outputs/lion --labels adamw lion --out plots/sweep

Each run is a run folder (its metrics.jsonl, written by the jsonl logger) or a .jsonl file.
Writes loss.png, lr.png and throughput.png into --out (default: plots/ in the first run folder).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from llmfoundry.utils.cli import add_script_arguments, script_errors
from llmfoundry.utils.errors import UserError


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", help="run folders or metrics .jsonl files")
    parser.add_argument(
        "--labels", nargs="+", help="legend label of each run (default: folder names)"
    )
    parser.add_argument("--out", help="folder for the PNG files (default: <first run>/plots)")
    add_script_arguments(parser, storage=False)
    args = parser.parse_args(argv)
    with script_errors(args):
        written = plot(args)
    for path in written:
        print(path)
    return written


def plot(args: argparse.Namespace) -> list[Path]:
    # Imported after parsing so --help answers without loading torch.
    from llmfoundry.loggers.plot import metrics_file, plot_runs, read_metrics

    if args.labels and len(args.labels) != len(args.runs):
        raise UserError(f"--labels gives {len(args.labels)} labels for {len(args.runs)} runs")
    files = [metrics_file(run) for run in args.runs]
    labels = args.labels or [f.parent.name if f.name == "metrics.jsonl" else f.stem for f in files]
    if len(set(labels)) != len(labels):
        raise UserError(f"runs need distinct labels, got {labels}: pass --labels")
    out = Path(args.out) if args.out else files[0].parent / "plots"
    runs = {label: read_metrics(f) for label, f in zip(labels, files, strict=True)}
    return plot_runs(runs, out)


if __name__ == "__main__":
    main()
