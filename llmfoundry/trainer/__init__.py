"""The event-driven trainer: events, time, state, engine and the fit loop.

Names are imported on first use (`llmfoundry.utils.lazy`): ``llmfoundry.trainer.time`` stays
free of torch for the config check.
"""

from typing import TYPE_CHECKING

from llmfoundry.utils.lazy import lazy_exports

if TYPE_CHECKING:
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
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        **dict.fromkeys(
            ("Algorithm", "Callback", "Engine", "Logger", "LoggerDestination"), ".engine"
        ),
        "Event": ".events",
        "EvalSet": ".model",
        "State": ".state",
        **dict.fromkeys(("Time", "Timestamp", "TimeUnit"), ".time"),
        "Trainer": ".trainer",
    },
)
