"""In-context-learning accuracy at every evaluation, beside the loss of the eval sets."""

from __future__ import annotations

import contextlib

from llmfoundry.core.engine import Callback, Logger
from llmfoundry.core.state import State
from llmfoundry.core.tokenizer import Tokenizer
from llmfoundry.distributed import unwrap_model
from llmfoundry.eval.composite import Composites
from llmfoundry.eval.forward import mesh_forward, splits_the_model
from llmfoundry.eval.foundry_tasks import load_icl_tasks, load_tasks
from llmfoundry.eval.icl import BATCH_SIZE, EvalTask, evaluate_tasks
from llmfoundry.tokenizers.tokenizer import prepare_tokenizer
from llmfoundry.utils.errors import UserError


class ICLEval(Callback):
    """At ``EVAL_BEFORE_ALL`` (model in eval mode; the trainer restores the RNG after
    evaluation), score the .jsonl `tasks` (llmfoundry/eval/icl.py) and llm-foundry's
    `icl_tasks` (a YAML path or its list of entries, llmfoundry/eval/foundry_tasks.py), and log
    ``icl/<task>/accuracy``, and the composites (llmfoundry/eval/composite.py) of `gauntlet`, an
    llm-foundry ``eval_gauntlet`` YAML (path, URL or its mapping), as
    ``icl/gauntlet/<category or average>``, and CORE over the benchmarks of `core` (a file of the
    same shape) as ``icl/core``. Every rank scores the same examples (a sharded model needs all of
    them), under the trainer's autocast, as its evaluation runs; under tensor, pipeline or
    context parallelism through the mesh (llmfoundry/eval/forward.py), with one process's
    answers.
    `limit` keeps it cheap during training; `batch_size`: rows per forward. `tokenizer`: a
    tokenizer.json path or URL, or any `Tokenizer`.
    """

    def __init__(
        self,
        tokenizer: str | Tokenizer,
        tasks: list[str] | None = None,
        shots: int = 0,
        seed: int = 17,
        limit: int | None = 100,
        icl_tasks: str | list[dict] | None = None,
        batch_size: int = BATCH_SIZE,
        gauntlet: str | dict | None = None,
        core: str | dict | None = None,
    ) -> None:
        self.tokenizer = (
            tokenizer
            if isinstance(tokenizer, Tokenizer)
            else prepare_tokenizer(tokenizer, require_eos=False)
        )
        self.tasks: list[EvalTask] = load_tasks(list(tasks or []))
        if icl_tasks is not None:
            self.tasks += load_icl_tasks(icl_tasks)
        if not self.tasks:
            raise UserError(
                "icl_eval has no tasks: give callbacks.icl_eval.tasks=[a.jsonl] or "
                "callbacks.icl_eval.icl_tasks=<llm-foundry icl_tasks YAML>"
            )
        self.shots, self.seed, self.limit, self.batch_size = shots, seed, limit, batch_size
        self.composites = Composites.read(gauntlet, core, resamples=0)
        self.composites.check({task.benchmark(shots) for task in self.tasks})

    def eval_before_all(self, state: State, logger: Logger) -> None:
        model, forward = unwrap_model(state.model), None
        if splits_the_model(state.strategy):
            forward = mesh_forward(state.model, state.strategy, state.precision)
        with state.precision.autocast() if forward is None else contextlib.nullcontext():
            results = evaluate_tasks(
                model,
                self.tokenizer,
                self.tasks,
                self.shots,
                self.seed,
                self.limit,
                forward=forward,
                batch_size=self.batch_size,
            )
        metrics = {f"icl/{name}/accuracy": r["accuracy"] for name, r in results.items()}
        logger.log_metrics(metrics | self.composites.metrics(results, "icl/"))
