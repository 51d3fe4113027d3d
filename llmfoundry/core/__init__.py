"""The vocabulary every layer shares: events, the engine and its plug-in kinds, state, time,
precision, the model contract, the tokenizer protocol, the batch keys and metric scalars.

It sits below everything that uses it (data, models, optim, loggers, distributed, checkpoint,
algorithms, callbacks, the trainer) and imports nothing of theirs; `tests/test_layers.py` holds
every package to that order. Names are imported on first use (`llmfoundry.utils.lazy`):
``llmfoundry.core.time`` stays free of torch for the config check.
"""

from llmfoundry.utils.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".engine": ("Algorithm", "Callback", "Engine", "Logger", "LoggerDestination"),
        ".events": ("Event",),
        ".metrics": ("IGNORE_INDEX", "SAMPLE_MASK", "DeviceScalar", "LanguageMetrics"),
        ".model": ("EvalSet",),
        ".precision": ("Precision",),
        ".state": ("State",),
        ".time": ("Time", "Timestamp", "TimeUnit"),
        ".tokenizer": ("Tokenizer",),
    },
)
