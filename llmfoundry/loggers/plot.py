"""Plot runs from their JSONL metrics (`JSONLLogger`): loss, learning rate and throughput.

Each figure overlays every run given, so runs of a sweep or a baseline and a change compare at
a glance. Files written into the output folder:

- ``loss.png``: training loss (solid) and each eval set's loss (dashed, markers)
- ``lr.png``: the learning rate of each parameter group (groups with identical curves share
  one line, labelled with all their names)
- ``throughput.png``: tokens per second and, when logged, MFU, on axes starting at zero (a rate
  axis that starts at its own minimum turns noise into cliffs)

A figure is skipped when no run logged its metrics (e.g. no LR monitor).
"""

from __future__ import annotations

import json
from pathlib import Path

from llmfoundry.utils.errors import MissingInput, MissingPackage, UserError

# The x axis of every figure: batches trained, the step of each JSONL record.
Series = dict[str, tuple[list[int], list[float]]]


def metrics_file(run: str | Path) -> Path:
    """A run folder (its metrics.jsonl) or a JSONL file itself."""
    path = Path(run)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise MissingInput(
            f"no metrics file at {path}: pass a run folder holding metrics.jsonl, or a .jsonl file "
            "written by the jsonl logger (add it with loggers=[console,progress,jsonl])"
        )
    return path


def read_metrics(path: str | Path) -> Series:
    """Every metric of a JSONL file as (steps, values), sorted by step.

    A step logged twice (a resumed run re-logs the steps after its checkpoint) keeps its last
    value. A truncated last line (the run was killed mid-write) is ignored; a bad line anywhere
    else is an error.
    """
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    by_metric: dict[str, dict[int, float]] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):
                break
            raise UserError(f"{path}:{number}: not a JSON line ({err.msg})") from None
        if "metrics" not in record:
            continue  # hyperparameters
        for name, value in record["metrics"].items():
            if value is not None:
                by_metric.setdefault(name, {})[int(record["step"])] = float(value)
    series: Series = {}
    for name, points in by_metric.items():
        steps = sorted(points)
        series[name] = (steps, [points[step] for step in steps])
    return series


def plot_runs(runs: dict[str, Series], out_dir: str | Path) -> list[Path]:
    """Draw the figures for `runs` (label -> series) into `out_dir`; returns the files written."""
    try:
        import matplotlib
    except ImportError:
        raise MissingPackage("plots need matplotlib: pip install 'llmfoundry[plot]'") from None
    matplotlib.use("Agg")  # files only: no display needed, works on headless machines
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # file stem -> panels, each (y label, [(metric, legend suffix)])
    figures = {
        "loss": [("loss", [("loss/train", "train"), *_eval_losses(runs)])],
        "lr": [("learning rate", _prefixed(runs, "lr/"))],
        "throughput": [
            ("tokens/s", [("throughput/tokens_per_sec", "")]),
            ("MFU", [("throughput/mfu", "")]),
        ],
    }
    from_zero = {"tokens/s", "MFU"}
    written = []
    for stem, all_panels in figures.items():
        panels = [(label, metrics) for label, metrics in all_panels if _any_logged(runs, metrics)]
        if not panels:
            continue
        fig, axes = plt.subplots(len(panels), 1, figsize=(8, 4 * len(panels)), squeeze=False)
        for ax, (label, panel_metrics) in zip(axes[:, 0], panels, strict=True):
            for run_label, series in runs.items():
                for metric, suffix, (steps, values) in _distinct_lines(series, panel_metrics):
                    is_eval = metric.startswith("eval/")
                    ax.plot(
                        steps,
                        values,
                        linestyle="--" if is_eval else "-",
                        marker="o" if is_eval else None,
                        markersize=3,
                        label=" ".join(part for part in (run_label, suffix) if part),
                    )
            if label in from_zero:
                ax.set_ylim(bottom=0)
            ax.set_xlabel("batch")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        path = out / f"{stem}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    if not written:
        raise UserError(
            "none of the runs logged loss, lr or throughput metrics: were the jsonl logger and the "
            "lr_monitor / speed_monitor callbacks on?"
        )
    return written


def _distinct_lines(
    series: Series, metrics: list[tuple[str, str]]
) -> list[tuple[str, str, tuple[list[int], list[float]]]]:
    """(metric, legend suffix, points) of each logged metric; identical curves drawn once, their
    suffixes joined (``group0, group1``), so equal lr groups do not hide one another."""
    lines: list[tuple[str, str, tuple[list[int], list[float]]]] = []
    for metric, suffix in metrics:
        if metric not in series:
            continue
        points = series[metric]
        same = next((i for i, line in enumerate(lines) if line[2] == points), None)
        if same is None:
            lines.append((metric, suffix, points))
        else:
            first, first_suffix, _ = lines[same]
            lines[same] = (first, f"{first_suffix}, {suffix}", points)
    return lines


def _eval_losses(runs: dict[str, Series]) -> list[tuple[str, str]]:
    names = {m for s in runs.values() for m in s if m.startswith("eval/") and m.endswith("/loss")}
    return [(name, name.split("/")[1]) for name in sorted(names)]


def _prefixed(runs: dict[str, Series], prefix: str) -> list[tuple[str, str]]:
    names = {m for s in runs.values() for m in s if m.startswith(prefix)}
    return [(name, name.removeprefix(prefix)) for name in sorted(names)]


def _any_logged(runs: dict[str, Series], metrics: list[tuple[str, str]]) -> bool:
    return any(metric in series for series in runs.values() for metric, _ in metrics)
