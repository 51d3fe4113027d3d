"""In-context-learning evaluation: accuracy of a causal LM on .jsonl tasks, n-shot, seeded.

A task is one .jsonl file; its kind follows from the fields of its lines:

- multiple choice, ``{"query": str, "choices": [str, ...], "gold": int}``: the prediction is
  the choice whose tokens, after the prompt, have the lowest mean loss per token (length
  normalised, so a long choice is not penalised for being long);
- language modelling (LAMBADA style), ``{"context": str, "continuation": str}`` (the passage and
  its last word, e.g. " dog"): correct when the most likely token at every position of the
  continuation (teacher forcing) is the continuation's token;
- question answering, ``{"question": str, "answer": str | [str, ...]}``: the model continues
  ``"Q: {question}\\nA:"`` greedily (``generation.generate``) to a newline or
  ``max_new_tokens``; correct when the stripped line equals an answer exactly.

n-shot prompts put ``shots`` other examples of the same task (with their answers) before each
query, chosen by a generator seeded with ``(seed, task name, example index)``, so results do not
depend on the order or the number of tasks. Prompt and answer are tokenized separately (as the
answer is scored on its own tokens); a prompt longer than the model's context loses its start.

Scoring only needs ``logits_fn(input_ids [1, L]) -> logits [1, L, V]``, so the same code scores
our model and transformers' (tests compare the two on an exported model).
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import torch
import torch.nn.functional as F

from llmfoundry.core.tokenizer import Tokenizer
from llmfoundry.eval.scoring import Forward, greedy_continue
from llmfoundry.models.family import CausalLM
from llmfoundry.models.generation import GenerationConfig, generate
from llmfoundry.utils.errors import UserError
from llmfoundry.utils.jsonl import read_jsonl

__all__ = ["KINDS", "Task", "evaluate_tasks", "load_task", "score_example", "summary_table"]

log = logging.getLogger(__name__)

LogitsFn = Callable[[torch.Tensor], torch.Tensor]
KINDS = {
    "multiple_choice": ("query", "choices", "gold"),
    "language_modeling": ("context", "continuation"),
    "qa": ("question", "answer"),
}
SEPARATOR = "\n\n"


@dataclass(frozen=True)
class Task:
    name: str
    kind: str
    examples: list[dict[str, Any]]


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


def _continuation_logprobs(
    logits_fn: LogitsFn, prompt: list[int], answer: list[int], max_seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities [A, V] at the positions predicting `answer`'s A tokens, and `answer`."""
    if not answer:
        raise UserError("an answer that tokenizes to nothing cannot be scored")
    ids = (prompt + answer)[-max_seq_len:]
    if len(ids) <= len(answer):
        raise UserError(f"an answer of {len(answer)} tokens leaves no room for its prompt")
    with torch.no_grad():
        logits = logits_fn(torch.tensor([ids]))[0].float()
    start = len(ids) - len(answer)
    return F.log_softmax(logits[start - 1 : len(ids) - 1], dim=-1), torch.tensor(answer)


def score_example(
    logits_fn: LogitsFn,
    tokenizer: Tokenizer,
    task: Task,
    index: int,
    prefix: str,
    max_seq_len: int,
    model: CausalLM | None = None,
    max_new_tokens: int = 32,
    forward: Forward | None = None,
) -> tuple[bool, Any]:
    """Whether the model answers example `index` of `task` right (module docstring: kinds),
    and its answer: the chosen index, the predicted token ids, or the generated text.
    `forward`: the model's where it is not whole on this process (questions are answered
    through it, by recompute)."""
    ex = task.examples[index]
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    if task.kind == "multiple_choice":
        prompt = encode(prefix + ex["query"])
        losses = []
        for choice in ex["choices"]:
            logprobs, answer = _continuation_logprobs(
                logits_fn, prompt, encode(choice), max_seq_len
            )
            losses.append(-logprobs.gather(1, answer[:, None]).mean().item())
        choice = min(range(len(losses)), key=losses.__getitem__)
        return choice == ex["gold"], choice
    if task.kind == "language_modeling":
        logprobs, answer = _continuation_logprobs(
            logits_fn, encode(prefix + ex["context"]), encode(ex["continuation"]), max_seq_len
        )
        predicted = logprobs.argmax(dim=-1)
        return bool((predicted == answer).all()), predicted.tolist()
    if model is None:
        raise ValueError(f"task {task.name}: question answering generates, so it needs the model")
    prompt = encode(f"{prefix}Q: {ex['question']}\nA:")
    prompt = prompt[-(max_seq_len - max_new_tokens) :]
    if forward is not None:
        line = lambda new: "\n" in tokenizer.decode(new)  # noqa: E731
        tokens = greedy_continue(forward, [prompt], max_new_tokens, max_seq_len, line)[0]
        text = tokenizer.decode(tokens).split("\n")[0].strip()
        return text in [a.strip() for a in ex["answer"]], text
    config = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0, stop=("\n",))
    out = generate(model, torch.tensor([prompt]), None, config, decode=tokenizer.decode)
    text = out.texts[0].strip()
    return text in [a.strip() for a in ex["answer"]], text


def evaluate_tasks(
    model: CausalLM,
    tokenizer: Tokenizer,
    tasks: Sequence[Task],
    shots: int = 0,
    seed: int = 17,
    limit: int | None = None,
    logits_fn: LogitsFn | None = None,
    forward: Forward | None = None,
) -> dict[str, dict[str, Any]]:
    """Accuracy per task: ``{name: {kind, accuracy, correct, examples, shots, scores}}``,
    `scores` each example's (1.0 right, 0.0 wrong, in order: what intervals resample).

    `limit` scores only the first examples of each task (shots still come from all of them).
    `forward` (llmfoundry/eval/scoring.py) runs the model where it is not whole on this process.
    """
    if shots < 0:
        raise UserError(f"shots must be >= 0, got {shots}")
    if tokenizer.vocab_size > model.config.vocab_size:
        raise UserError(
            f"the tokenizer has {tokenizer.vocab_size} tokens, more "
            f"than the model's vocab_size {model.config.vocab_size}; give the model's tokenizer"
        )
    for task in tasks:  # before scoring any: a short task would otherwise fail after the others
        _check_shots(task, shots)
    if forward is not None:
        logits_fn = functools.partial(forward, reduce=lambda logits: logits)
    logits_fn = logits_fn or model
    was_training = model.training
    model.eval()
    results = {}
    try:
        for task in tasks:
            n = len(task.examples) if limit is None else min(limit, len(task.examples))
            scores = [
                float(
                    score_example(
                        logits_fn,
                        tokenizer,
                        task,
                        i,
                        _prefix(task, i, shots, seed),
                        model.config.max_seq_len,
                        model,
                        forward=forward,
                    )[0]
                )
                for i in range(n)
            ]
            correct = int(sum(scores))
            results[task.name] = {
                "kind": task.kind,
                "accuracy": correct / n,
                "correct": correct,
                "examples": n,
                "shots": shots,
                "scores": scores,
            }
            log.info("%s (%s, %d-shot): %d/%d", task.name, task.kind, shots, correct, n)
    finally:
        model.train(was_training)
    return results


def summary_table(results: dict[str, dict[str, Any]]) -> str:
    """The results as a fixed-width text table, one task per line and the mean accuracy."""
    width = max([len("task"), *map(len, results)])
    lines = [f"{'task':<{width}}  {'kind':<17}  shots  examples  accuracy"]
    for name, r in results.items():
        lines.append(
            f"{name:<{width}}  {r['kind']:<17}  {r['shots']:>5}  {r['examples']:>8}  "
            f"{r['accuracy']:>8.4f}"
        )
    if results:
        mean = sum(r["accuracy"] for r in results.values()) / len(results)
        lines.append(f"{'mean':<{width}}  {'':<17}  {'':>5}  {'':>8}  {mean:>8.4f}")
    return "\n".join(lines)
