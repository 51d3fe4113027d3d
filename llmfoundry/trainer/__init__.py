"""The event-driven trainer: events, time, state, engine and the fit loop."""

from llmfoundry.trainer.engine import Algorithm, Callback, Engine, Logger, LoggerDestination
from llmfoundry.trainer.events import Event
from llmfoundry.trainer.model import EvalSet
from llmfoundry.trainer.state import State
from llmfoundry.trainer.time import Time, Timestamp, TimeUnit
from llmfoundry.trainer.trainer import Trainer

__all__ = [
    "Algorithm",
    "Callback",
    "Engine",
    "EvalSet",
    "Event",
    "Logger",
    "LoggerDestination",
    "State",
    "Time",
    "TimeUnit",
    "Timestamp",
    "Trainer",
]
