"""In-context-learning accuracy at every evaluation, beside the loss of the eval sets."""

from __future__ import annotations

from llmfoundry.core.engine import Callback, Logger
from llmfoundry.core.state import State
from llmfoundry.core.tokenizer import Tokenizer
from llmfoundry.distributed import unwrap_model
from llmfoundry.eval.composite import Composites
from llmfoundry.eval.icl import evaluate_tasks, load_task
from llmfoundry.tokenizers.tokenizer import prepare_tokenizer


class ICLEval(Callback):
    """At ``EVAL_BEFORE_ALL`` (model in eval mode; the trainer restores the RNG after
    evaluation), score the .jsonl `tasks` (llmfoundry/eval/icl.py) and log
    ``icl/<task>/accuracy``, and the composites (llmfoundry/eval/composite.py) of `gauntlet`, an
    llm-foundry ``eval_gauntlet`` YAML (path, URL or its mapping), as
    ``icl/gauntlet/<category or average>``, and CORE over the benchmarks of `core` (a file of the
    same shape) as ``icl/core``. Every rank scores the same examples (a sharded model needs all of
    them); `limit` keeps it cheap during training. `tokenizer`: a tokenizer.json path or URL,
    or any `Tokenizer`.
    """

    runs_the_model = True

    def __init__(
        self,
        tokenizer: str | Tokenizer,
        tasks: list[str],
        shots: int = 0,
        seed: int = 17,
        limit: int | None = 100,
        gauntlet: str | dict | None = None,
        core: str | dict | None = None,
    ) -> None:
        self.tokenizer = (
            tokenizer
            if isinstance(tokenizer, Tokenizer)
            else prepare_tokenizer(tokenizer, require_eos=False)
        )
        self.tasks = [load_task(url) for url in tasks]
        self.shots, self.seed, self.limit = shots, seed, limit
        self.composites = Composites.read(gauntlet, core, resamples=0)
        self.composites.check({(task.name, shots) for task in self.tasks})

    def eval_before_all(self, state: State, logger: Logger) -> None:
        model = unwrap_model(state.model)
        results = evaluate_tasks(
            model, self.tokenizer, self.tasks, self.shots, self.seed, self.limit
        )
        metrics = {f"icl/{name}/accuracy": r["accuracy"] for name, r in results.items()}
        logger.log_metrics(metrics | self.composites.metrics(results, "icl/"))
