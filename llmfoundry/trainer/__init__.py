"""The event-driven trainer: events, time, state, engine and the fit loop.

Names are imported on first use (`llmfoundry.utils.lazy`): ``llmfoundry.trainer.time`` stays
free of torch for the config check.
"""

from llmfoundry.utils.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".engine": ("Algorithm", "Callback", "Engine", "Logger", "LoggerDestination"),
        ".events": ("Event",),
        ".model": ("EvalSet",),
        ".state": ("State",),
        ".time": ("Time", "Timestamp", "TimeUnit"),
        ".trainer": ("Trainer",),
    },
)
