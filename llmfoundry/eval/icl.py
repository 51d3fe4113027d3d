"""In-context-learning evaluation: accuracy of a causal LM on tasks, batched, on any mesh.

Tasks come in two formats, each prepared into the same tokenized `Question`s:

- ours, one .jsonl file per task (`load_task`), its kind following from its lines' fields:

  - multiple choice, ``{"query": str, "choices": [str, ...], "gold": int}``: the prediction is
    the choice whose tokens, after the prompt, have the lowest mean loss per token (length
    normalised, so a long choice is not penalised for being long);
  - language modelling (LAMBADA style), ``{"context": str, "continuation": str}`` (the passage
    and its last word, e.g. " dog"): correct when the most likely token at every position of
    the continuation (teacher forcing) is the continuation's token;
  - question answering, ``{"question": str, "answer": str | [str, ...]}``: the model continues
    ``"Q: {question}\\nA:"`` greedily to a newline or ``max_new_tokens``; correct when the
    stripped line equals an answer exactly.

  n-shot prompts put ``shots`` other examples of the same task (with their answers) before each
  query, chosen by a generator seeded with ``(seed, task name, example index)``, so results do
  not depend on the order or the number of tasks. Prompt and answer are tokenized separately
  (the answer is scored on its own tokens); a prompt longer than the model's context loses its
  start.
- llm-foundry's ``icl_tasks`` YAML entries and task files (llmfoundry/eval/foundry_tasks.py),
  scored as llm-foundry scores them.

Scoring runs on llmfoundry/eval/scoring.py: all of a task's ranked continuations in one
`score_continuations` call and all its prompts to answer in one `greedy_continue` call,
`batch_size` rows per forward, through a `Forward` (the whole model on this process by default;
a mesh's runs it where the model is sharded), so the same code scores any model on any mesh.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Literal, Protocol

from llmfoundry.core.tokenizer import Tokenizer
from llmfoundry.eval.scoring import (
    Continuation,
    Forward,
    ModelForward,
    greedy_continue,
    score_continuations,
)
from llmfoundry.models.family import CausalLM
from llmfoundry.utils.errors import UserError
from llmfoundry.utils.jsonl import read_jsonl

__all__ = [
    "BATCH_SIZE",
    "KINDS",
    "EvalTask",
    "Generation",
    "Prepared",
    "Question",
    "Task",
    "check_tokenizer_fits",
    "evaluate_tasks",
    "load_task",
]

log = logging.getLogger(__name__)

KINDS = {
    "multiple_choice": ("query", "choices", "gold"),
    "language_modeling": ("context", "continuation"),
    "qa": ("question", "answer"),
}
SEPARATOR = "\n\n"
# Rows per forward: enough that an accelerator is not left idle by one-row forwards, few enough
# that the [batch, length, vocab] logits of 2k-token rows and a 50k vocabulary (6.5 GB in fp32)
# fit. On a CPU 4, 16 and 64 cost the same (bench/RESULTS.md).
BATCH_SIZE = 16
QA_MAX_NEW_TOKENS = 32

# How a prepared task's questions are answered: "choice", the choice of lowest mean loss per
# token; "greedy", the one continuation right when each of its tokens is the most likely;
# "generate", the greedy continuation of the prompt, judged against the answers.
Rule = Literal["choice", "greedy", "generate"]


@dataclass(frozen=True)
class Question:
    """One example with its shots, tokenized: the `choices` (continuations after their
    contexts) that the "choice" and "greedy" rules score, `gold` the right one; or the `prompt`
    that the "generate" rule continues, and the `answers` it is judged against."""

    choices: tuple[Continuation, ...] = ()
    gold: int = 0
    prompt: tuple[int, ...] = ()
    answers: tuple[str, ...] = ()


@dataclass(frozen=True)
class Generation:
    """How a task's prompts are continued and judged: greedily, up to `max_new_tokens`, to
    `eos_id` or the first of the `stop` strings; the text, cut before a stop string, is right
    when `judge(text, answers)`."""

    max_new_tokens: int
    stop: tuple[str, ...]
    eos_id: int | None
    judge: Callable[[str, Sequence[str]], bool]


@dataclass(frozen=True)
class Prepared:
    """A task ready to score: `name` keys its results, `label` is the task without its shots
    (llm-foundry's ``label``), `categories` each question's category where the task has them."""

    name: str
    label: str
    kind: str
    rule: Rule
    shots: int
    max_seq_len: int
    questions: list[Question]
    generation: Generation | None = None
    categories: list[str] | None = None


class EvalTask(Protocol):
    """A task `evaluate_tasks` scores: ours (`Task`) or llm-foundry's (`FoundryTask`)."""

    @property
    def name(self) -> str: ...

    def benchmark(self, shots: int) -> tuple[str, int]:
        """The ``(label, shots)`` its results carry (composites find benchmarks by it), when
        our .jsonl tasks are given `shots`."""

    def check(self, tokenizer: Tokenizer, max_seq_len: int, shots: int) -> None:
        """Raise `UserError` for what would fail `prepare`, cheaply (before any is scored)."""

    def prepare(
        self, tokenizer: Tokenizer, max_seq_len: int, shots: int, seed: int, limit: int | None
    ) -> Prepared: ...


def _exact_line(text: str, answers: Sequence[str]) -> bool:
    return text.strip() in [a.strip() for a in answers]


@dataclass(frozen=True)
class Task:
    """One of our .jsonl tasks (module docstring)."""

    name: str
    kind: str
    examples: list[dict[str, Any]]

    def benchmark(self, shots: int) -> tuple[str, int]:
        return self.name, shots

    def check(self, tokenizer: Tokenizer, max_seq_len: int, shots: int) -> None:
        _check_shots(self, shots)

    def prepare(
        self, tokenizer: Tokenizer, max_seq_len: int, shots: int, seed: int, limit: int | None
    ) -> Prepared:
        _check_shots(self, shots)
        n = len(self.examples) if limit is None else min(limit, len(self.examples))
        questions = [self._question(tokenizer, i, _prefix(self, i, shots, seed)) for i in range(n)]
        rule: Rule = {"multiple_choice": "choice", "language_modeling": "greedy"}.get(
            self.kind, "generate"
        )
        qa = Generation(QA_MAX_NEW_TOKENS, ("\n",), None, _exact_line)
        return Prepared(
            self.name, self.name, self.kind, rule, shots, max_seq_len, questions,
            qa if rule == "generate" else None,
        )  # fmt: skip

    def _question(self, tokenizer: Tokenizer, index: int, prefix: str) -> Question:
        ex = self.examples[index]
        encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        if self.kind == "multiple_choice":
            prompt = encode(prefix + ex["query"])
            choices = tuple(Continuation(prompt, encode(c)) for c in ex["choices"])
            return Question(choices, ex["gold"])
        if self.kind == "language_modeling":
            context = encode(prefix + ex["context"])
            return Question((Continuation(context, encode(ex["continuation"])),))
        prompt = encode(f"{prefix}Q: {ex['question']}\nA:")
        return Question(prompt=tuple(prompt), answers=tuple(ex["answer"]))


def _kind(example: dict[str, Any], where: str) -> str:
    for kind, keys in KINDS.items():
        if all(k in example for k in keys):
            return kind
    raise UserError(
        f"{where}: cannot tell the task kind from keys {sorted(example)}; lines need one of "
        + "; ".join(f"{k}: {list(v)}" for k, v in KINDS.items())
    )


def load_task(url: str, name: str | None = None) -> Task:
    """The task in the .jsonl file ``url`` (local or fsspec), named after the file by default."""
    examples, kind = [], None
    for where, example in read_jsonl(url):
        this = _kind(example, where)
        if kind is not None and this != kind:
            raise UserError(f"{where}: a {this} example in a {kind} task; one kind per file")
        kind = this
        if kind == "multiple_choice":
            choices, gold = example["choices"], example["gold"]
            if not (isinstance(choices, list) and len(choices) >= 2):
                raise UserError(f"{where}: 'choices' must list at least two strings")
            if not (isinstance(gold, int) and 0 <= gold < len(choices)):
                raise UserError(f"{where}: 'gold' must index 'choices', got {gold!r}")
        if kind == "qa" and isinstance(example["answer"], str):
            example["answer"] = [example["answer"]]
        examples.append(example)
    if kind is None:
        raise UserError(f"{url} holds no examples")
    return Task(name or PurePosixPath(url).stem, kind, examples)


def _shot(task: Task, example: dict[str, Any]) -> str:
    """An example written out with its answer, as a shot before the query."""
    if task.kind == "multiple_choice":
        return example["query"] + example["choices"][example["gold"]] + SEPARATOR
    if task.kind == "language_modeling":
        return example["context"] + example["continuation"] + SEPARATOR
    return f"Q: {example['question']}\nA: {example['answer'][0]}{SEPARATOR}"


def _check_shots(task: Task, shots: int) -> None:
    """Each query's shots are other examples of its task, so a task needs `shots` + 1 of them."""
    if shots >= len(task.examples):
        raise UserError(
            f"task {task.name} has {len(task.examples)} examples, too few for {shots} shots "
            f"(each query's shots are other examples of its task); use --shots "
            f"{len(task.examples) - 1} or fewer, or add examples"
        )


def _prefix(task: Task, index: int, shots: int, seed: int) -> str:
    _check_shots(task, shots)
    others = [i for i in range(len(task.examples)) if i != index]
    chosen = random.Random(f"{seed}:{task.name}:{index}").sample(others, shots)
    return "".join(_shot(task, task.examples[i]) for i in chosen)


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """`text` before the first of the `stop` strings it holds (all of it when none)."""
    hits = [text.find(s) for s in stop if s in text]
    return text[: min(hits)] if hits else text


def score_prepared(
    forward: Forward, tokenizer: Tokenizer, task: Prepared, batch_size: int = BATCH_SIZE
) -> list[float]:
    """Each question's score (1.0 right, 0.0 wrong, in order) by its task's rule: one
    `score_continuations` call for all choices, or one `greedy_continue` for all prompts."""
    if task.rule == "generate":
        return _score_generated(forward, tokenizer, task, batch_size)
    flat = [c for q in task.questions for c in q.choices]
    scored = iter(score_continuations(forward, flat, task.max_seq_len, batch_size))
    scores = []
    for question in task.questions:
        mine = [next(scored) for _ in question.choices]
        if task.rule == "greedy":
            right = all(s.greedy for s in mine)
        else:  # the first of equal losses wins, as min() and llm-foundry's index(min) pick
            losses = [s.mean_loss for s in mine]
            right = losses.index(min(losses)) == question.gold
        scores.append(float(right))
    return scores


def _score_generated(
    forward: Forward, tokenizer: Tokenizer, task: Prepared, batch_size: int
) -> list[float]:
    generation = task.generation
    if generation is None:
        raise ValueError(f"task {task.name}: a generated task needs its Generation")

    def done(new: list[int]) -> bool:
        if generation.eos_id is not None and new[-1] == generation.eos_id:
            return True
        return bool(generation.stop) and any(s in tokenizer.decode(new) for s in generation.stop)

    outputs = greedy_continue(
        forward,
        [q.prompt for q in task.questions],
        generation.max_new_tokens,
        task.max_seq_len,
        stop=done,
        batch_size=batch_size,
    )
    return [
        float(generation.judge(cut_at_stop(tokenizer.decode(new), generation.stop), q.answers))
        for q, new in zip(task.questions, outputs, strict=True)
    ]


def _results(task: Prepared, scores: list[float]) -> dict[str, dict[str, Any]]:
    """The task's result, or with categories one per category, ``<task>/<category>`` with the
    task's label and shots, as llm-foundry reports them (its gauntlet, and ours in
    llmfoundry/eval/composite.py, average them into the task)."""
    head = {"kind": task.kind, "label": task.label, "shots": task.shots}
    if task.categories is None:
        return {task.name: head | _counts(scores)}
    return {
        f"{task.name}/{name}": head
        | {"category": name}
        | _counts([s for s, c in zip(scores, task.categories, strict=True) if c == name])
        for name in sorted(set(task.categories))
    }


def _counts(scores: list[float]) -> dict[str, Any]:
    correct = int(sum(scores))
    return {
        "accuracy": correct / len(scores),
        "correct": correct,
        "examples": len(scores),
        "scores": scores,
    }


def check_tokenizer_fits(tokenizer: Tokenizer, vocab_size: int) -> None:
    """Refuse a tokenizer of more tokens than the model's vocabulary: another model's, whose
    ids past it would index no embedding."""
    if tokenizer.vocab_size > vocab_size:
        raise UserError(
            f"the tokenizer has {tokenizer.vocab_size} tokens, more "
            f"than the model's vocab_size {vocab_size}; give the model's tokenizer"
        )


def evaluate_tasks(
    model: CausalLM,
    tokenizer: Tokenizer,
    tasks: Sequence[EvalTask],
    shots: int = 0,
    seed: int = 17,
    limit: int | None = None,
    forward: Forward | None = None,
    batch_size: int = BATCH_SIZE,
) -> dict[str, dict[str, Any]]:
    """Accuracy per task: ``{name: {kind, label, accuracy, correct, examples, shots, scores}}``,
    `scores` each example's (1.0 right, 0.0 wrong, in order: what intervals resample); a task
    with categories gives one result per category (``<name>/<category>``, with ``category``).

    `shots` and `seed` apply to our .jsonl tasks (llm-foundry's set their own). `limit` scores
    only the first examples of each task (shots still come from all of them). `forward`
    (llmfoundry/eval/scoring.py) runs the model where it is not whole on this process.
    """
    if shots < 0:
        raise UserError(f"shots must be >= 0, got {shots}")
    if batch_size < 1:
        raise UserError(f"batch_size must be >= 1, got {batch_size}")
    check_tokenizer_fits(tokenizer, model.config.vocab_size)
    names = [task.name for task in tasks]
    if len(set(names)) < len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise UserError(f"two tasks are named {twice}; their results would overwrite each other")
    max_seq_len = model.config.max_seq_len
    for task in tasks:  # before scoring any: a short task would otherwise fail after the others
        task.check(tokenizer, max_seq_len, shots)
    forward = forward or ModelForward(model)
    was_training = model.training
    model.eval()
    results = {}
    try:
        for one in tasks:  # prepared one at a time: a task's tokens are held while it is scored
            task = one.prepare(tokenizer, max_seq_len, shots, seed, limit)
            try:
                scores = score_prepared(forward, tokenizer, task, batch_size)
            except UserError as err:
                raise UserError(f"task {task.name}: {err}") from None
            results |= _results(task, scores)
            log.info(
                "%s (%s, %d-shot): %d/%d",
                task.name,
                task.kind,
                task.shots,
                sum(scores),
                len(scores),
            )
    finally:
        model.train(was_training)
    return results
