"""Sweeps: the objective a sweeper minimises, and the trials of a finished sweep.

`scripts/train.py` returns `objective(state)` from its Hydra task function, so any Hydra
sweeper can optimise it: the basic sweeper (a grid, ``-m optimizer.lr=1e-3,3e-3``) ignores it,
the Optuna sweeper (``hydra/sweeper=optuna``, search spaces in conf/sweep/) minimises it. Each
trial is a run folder ``outputs/<sweep>/<number>`` (`llmfoundry.config.run_name`) holding
Hydra's ``.hydra/overrides.yaml``, the JSONL metrics and the status file, which is all
`trials` needs: it works on a sweep still running or launched elsewhere (submitit on Slurm).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from llmfoundry.core.state import State
from llmfoundry.loggers.plot import Series, read_metrics
from llmfoundry.utils.errors import MissingInput
from llmfoundry.utils.status_file import read_status


def objective(state: State) -> float:
    """The final validation loss: the first eval set's (the data's eval_split), else the last
    training loss when the run has no eval set. NaN when there is neither (a sweeper then ranks
    the trial last)."""
    names = [f"eval/{name}/loss" for name in state.eval_dataloaders]
    for name in names:
        if name in state.eval_metrics:
            return float(state.eval_metrics[name])
    return float(state.train_loss) if state.train_loss is not None else math.nan


@dataclass
class Trial:
    name: str
    folder: Path
    overrides: list[str]
    status: str
    final_loss: float | None
    tokens_per_sec: float | None
    series: Series


def trials(sweep_dir: str | Path) -> list[Trial]:
    """Every trial folder (one with .hydra/overrides.yaml) of a sweep, by job number."""
    root = Path(sweep_dir)
    folders = [p.parent.parent for p in root.glob("*/.hydra/overrides.yaml")]
    if not folders:
        raise MissingInput(
            f"no trials in {root}: pass a sweep folder (outputs/sweep-<time>) whose numbered "
            "folders hold .hydra/overrides.yaml"
        )
    found = []
    # Numbered folders in numeric order (2 before 10).
    for folder in sorted(folders, key=lambda p: (len(p.name), p.name)):
        overrides = [str(o) for o in OmegaConf.load(folder / ".hydra" / "overrides.yaml")]
        metrics = folder / "metrics.jsonl"
        series = read_metrics(metrics) if metrics.is_file() else {}
        try:
            status = read_status(str(folder / "status.json")) or {}
        except ValueError:  # not a status file (`read_status`): the trial is still listed
            status = {"status": "unreadable"}
        found.append(
            Trial(
                name=f"{root.name}/{folder.name}",
                folder=folder,
                overrides=overrides,
                status=status.get("status", "unknown"),
                final_loss=_final_loss(series, _eval_split(folder)),
                tokens_per_sec=_mean(series.get("throughput/tokens_per_sec")),
                series=series,
            )
        )
    return found


def _eval_split(folder: Path) -> str | None:
    """The trial's main eval set (data.eval_split), whose loss `objective` returned."""
    config = folder / ".hydra" / "config.yaml"
    if not config.is_file():
        return None
    return OmegaConf.select(OmegaConf.load(config), "data.eval_split", default=None)


def _final_loss(series: Series, eval_split: str | None) -> float | None:
    """The last loss of the main eval set, else the last training loss (as `objective`)."""
    for metric in (f"eval/{eval_split}/loss", "loss/train"):
        if metric in series and series[metric][1]:
            return series[metric][1][-1]
    return None


def _mean(points: tuple[list[int], list[float]] | None) -> float | None:
    if not points or not points[1]:
        return None
    return sum(points[1]) / len(points[1])
