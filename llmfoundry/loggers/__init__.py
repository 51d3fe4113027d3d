"""Logger destinations: where metrics go. Several can be active at once."""

from llmfoundry.loggers.console import ConsoleLogger
from llmfoundry.loggers.progress import ProgressBarLogger

__all__ = ["ConsoleLogger", "ProgressBarLogger"]
