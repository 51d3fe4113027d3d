"""Logger destinations: where metrics go. Several can be active at once.

TensorBoard and W&B are imported only when such a logger starts, so neither is required to
train without it. Plots of logged runs: `llmfoundry.loggers.plot` (``scripts/plot.py``).
"""

from llmfoundry.loggers.console import ConsoleLogger
from llmfoundry.loggers.jsonl import JSONLLogger
from llmfoundry.loggers.progress import ProgressBarLogger
from llmfoundry.loggers.tensorboard_logger import TensorBoardLogger
from llmfoundry.loggers.wandb_logger import WandBLogger

__all__ = ["ConsoleLogger", "JSONLLogger", "ProgressBarLogger", "TensorBoardLogger", "WandBLogger"]
