"""The engine runs algorithms, callbacks and loggers on each event, in a fixed order.

Order on every event: algorithms (those whose ``match`` is true), then callbacks, then logger
destinations. On AFTER_* events (``Event.is_after``) algorithms run in reverse order, so an
algorithm that wraps a step (changes something before, restores it after) nests correctly with
the others. Callbacks and loggers always run in the order given.

Algorithms change the training (the batch, the model, the gradients); callbacks observe it and
act around it (metrics, checkpoints, early stopping); logger destinations receive metrics.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Sequence
from typing import Any

from llmfoundry.core.events import Event
from llmfoundry.core.metrics import DeviceScalar
from llmfoundry.core.state import State
from llmfoundry.utils.errors import UserError


class Algorithm:
    """Changes training at the events it matches. Subclasses override `match` and `apply`."""

    def match(self, event: Event, state: State) -> bool:
        raise NotImplementedError

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


class Callback:
    """Observes events: define a method named after the event (e.g. ``batch_end``)."""

    def run_event(self, event: Event, state: State, logger: Logger) -> None:
        handler = getattr(self, event.value, None)
        if handler is not None:
            handler(state, logger)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state

    def close(self) -> None:
        """Release files and threads; called once when training ends, even after an error."""


class LoggerDestination(Callback):
    """Where metrics go (console, file, TensorBoard, W&B). Also hooks events like a callback."""

    def log_metrics(self, metrics: dict[str, float | DeviceScalar], step: int) -> None:
        """Record ``metrics`` at batch ``step``. A value is a float or a `DeviceScalar` (the
        trainer's ``loss/train``, gradient clipping's ``grad/norm``: still on the device);
        ``float(value)`` reads either, and for a DeviceScalar waits for the device, so a
        destination reads them when it writes, not on every call (`llmfoundry.loggers.buffered`).
        """
        del metrics, step

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        del hyperparameters

    def flush(self) -> None:
        """Write everything logged so far to where this destination keeps it (its file, its
        remote run). Called before every checkpoint save, so a checkpoint never covers steps
        whose metrics a kill could still lose: the resumed run logs only the steps after it."""


class Logger:
    """The facade algorithms and callbacks log through; it fans out to every destination."""

    def __init__(self, state: State, destinations: Sequence[LoggerDestination] = ()) -> None:
        self._state = state
        self.destinations = list(destinations)

    def log_metrics(self, metrics: dict[str, float | DeviceScalar]) -> None:
        """Send ``metrics`` (floats or `DeviceScalar`s, see `LoggerDestination.log_metrics`) to
        every destination at the current batch."""
        for destination in self.destinations:
            destination.log_metrics(metrics, step=self._state.timestamp.batch)

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        for destination in self.destinations:
            destination.log_hyperparameters(hyperparameters)

    def flush(self) -> None:
        """`LoggerDestination.flush` every destination."""
        for destination in self.destinations:
            destination.flush()


_EVENT_NAMES = sorted(event.value for event in Event)
_EVENT_PREFIXES = ("before_", "after_", "eval_")


def check_event_methods(callback: Callback) -> None:
    """Refuse a method that looks like a misspelt event handler (it would never be called).

    A public method taking ``(state, logger)`` whose name is no event but is close to one
    (``batch_ended``) or uses an event prefix (``before_``, ``after_``, ``eval_``) is an error;
    other methods of that shape (``CheckpointSaver.save``) are ordinary API.
    """
    api = set(dir(LoggerDestination))
    for name in dir(type(callback)):
        method = getattr(type(callback), name)
        if name.startswith("_") or name in api or name in _EVENT_NAMES or not callable(method):
            continue
        try:
            params = list(inspect.signature(method).parameters)
        except (TypeError, ValueError):
            continue
        close = difflib.get_close_matches(name, _EVENT_NAMES, n=1, cutoff=0.8)
        if params[1:] == ["state", "logger"] and (close or name.startswith(_EVENT_PREFIXES)):
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise UserError(
                f"{type(callback).__name__}.{name}(state, logger) matches no event and would "
                f"never be called; {hint}events are listed in llmfoundry/core/events.md "
                "(rename it, or make it private with a leading underscore)"
            )


class Engine:
    def __init__(
        self,
        state: State,
        logger: Logger,
        algorithms: Sequence[Algorithm] = (),
        callbacks: Sequence[Callback] = (),
    ) -> None:
        for callback in (*callbacks, *logger.destinations):
            check_event_methods(callback)
        self.state = state
        self.logger = logger
        state.algorithms = list(algorithms)
        state.callbacks = list(callbacks)

    def run_event(self, event: Event) -> None:
        state = self.state
        algorithms = reversed(state.algorithms) if event.is_after else state.algorithms
        for algorithm in algorithms:
            if algorithm.match(event, state):
                algorithm.apply(event, state, self.logger)
        for callback in (*state.callbacks, *self.logger.destinations):
            callback.run_event(event, state, self.logger)

    def close(self) -> None:
        for callback in (*self.state.callbacks, *self.logger.destinations):
            callback.close()
