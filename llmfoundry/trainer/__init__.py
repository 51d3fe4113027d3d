"""The training loop (`Trainer`), with the vocabulary a user's plug-in needs beside it.

The vocabulary itself lives in `llmfoundry.core`; it is re-exported here so that a user's
``from llmfoundry.trainer import Callback, Event, State, Trainer`` is one line. Code inside the
package imports it from `llmfoundry.core`. Names are imported on first use
(`llmfoundry.utils.lazy`).
"""

from llmfoundry.utils.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "llmfoundry.core.engine": (
            "Algorithm",
            "Callback",
            "Engine",
            "Logger",
            "LoggerDestination",
        ),
        "llmfoundry.core.events": ("Event",),
        "llmfoundry.core.model": ("EvalSet",),
        "llmfoundry.core.state": ("State",),
        "llmfoundry.core.time": ("Time", "Timestamp", "TimeUnit"),
        ".trainer": ("Trainer",),
    },
)
