"""Train an MPT model.

    python scripts/train.py                                  # the demo: mpt-tiny on data/demo/mds
    python scripts/train.py model=mpt-1b data.remote=s3://bucket/mds max_duration=10000ba
    torchrun --nproc_per_node=8 scripts/train.py model=mpt-1b ...

Every value in conf/ can be overridden as key=value; `--cfg job` prints the composed config.
Sweeps: `-m optimizer.lr=1e-3,3e-3 model.n_layers=2,4` (a grid), or an Optuna search space from
conf/sweep/: `-m +sweep=tiny_lr` (README, Sweeps).
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from llmfoundry.build import build_trainer
from llmfoundry.config import register_resolvers
from llmfoundry.config.preflight import preflight
from llmfoundry.launch.sweeps import objective
from llmfoundry.utils.logs import configure_logging

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


@hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float:
    """Train; return the final validation loss, which sweepers (-m, hydra/sweeper=optuna) minimise."""
    run_dir = HydraConfig.get().runtime.output_dir
    configure_logging(Path(run_dir) / "train.log")  # the console's lines, kept in the run folder
    return objective(build_trainer(cfg, run_dir).fit())


if __name__ == "__main__":
    register_resolvers()
    preflight(sys.argv[1:], CONF_DIR)
    main()
