"""llm-foundry's in-context-learning tasks: its ``icl_tasks`` YAML and task files, prompted,
tokenized and scored as llm-foundry 0.22 does (llmfoundry/eval/datasets and metrics/nlp.py
there), written here for our `Tokenizer` and llmfoundry/eval/scoring.py.

An entry (``label``, ``dataset_uri``, ``num_fewshot`` a number or a list: one task per number,
named ``<label>/<n>-shot``, ``icl_task_type``) reads a .jsonl file of one of four shapes:

- ``multiple_choice``: ``{"query", "choices", "gold"}``; the choice of lowest mean
  cross-entropy per token after the context wins;
- ``schema``: ``{"context_options", "continuation", "gold"}``; the context after which the
  continuation has the lowest mean cross-entropy per token wins;
- ``language_modeling``: ``{"context", "continuation"}``; right when every continuation token is
  the most likely one;
- ``generation_task_with_answers`` (older name ``question_answering``): ``{"context",
  "answer", "aliases"?, "chain_of_thought"?}``; the greedy continuation, up to the longest
  answer's tokens (+10 with a ``cot_delimiter``), the end-of-text token or an
  ``early_stopping_criteria`` string, cut before that string and after the last
  ``cot_delimiter``, normalized (``do_normalization``: lower case, no punctuation or articles)
  or stripped, is right when it starts with an answer or alias treated the same way.

A prompt is ``prompt_string``, then ``num_fewshot`` other examples with their answers, then the
query: ``prelimiter`` + context + ``continuation_delimiter`` (each after ``example_delimiter``
but the first), string fields stripped and the query's end stripped; the prompt and shots are
tokenized with the tokenizer's special tokens (a BOS), the query and answers without, and an
answer gets a leading space where the tokenizer reads " a" as one token. The shots are drawn as
llm-foundry draws them (one `random.Random(fewshot_random_seed)` per task, 1234 by default,
consumed example by example), so prompts are llm-foundry's token for token.
``has_categories`` splits the file by each line's ``category`` (shots drawn within it), one
result per category (``<label>/<n>-shot/<category>``), as llm-foundry reports them.

Refused in one line: other keys, ``code_evaluation`` (it runs the model's code), ``hf://``
datasets (no Hub here). Differences: stop strings are matched as plain text (llm-foundry
joins them into a regular expression); ``batch_size`` only sets llm-foundry's batching and is
accepted and unused (``evaluate_tasks`` batches by rows).
"""

from __future__ import annotations

import logging
import random
import re
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from omegaconf import ListConfig, OmegaConf

from llmfoundry.core.tokenizer import Tokenizer
from llmfoundry.eval.icl import EvalTask, Generation, Prepared, Question, Rule, load_task
from llmfoundry.eval.scoring import Continuation
from llmfoundry.utils import storage
from llmfoundry.utils.errors import MissingInput, UserError
from llmfoundry.utils.jsonl import read_jsonl
from llmfoundry.utils.yaml_guard import safe_load

__all__ = [
    "MAX_YAML_BYTES",
    "FoundryTask",
    "fewshot_indices",
    "load_icl_tasks",
    "load_tasks",
    "normalize_answer",
]

log = logging.getLogger(__name__)

# A tasks file lists a few hundred entries of a few lines each; past this it is not one.
MAX_YAML_BYTES = 4 * 2**20
# llm-foundry's extra answer room when a chain of thought precedes the answer.
COT_ANSWER_BUFFER = 10

# Each type's fields (beyond the optional ones) and how its questions are answered.
TYPES: dict[str, tuple[tuple[str, ...], Rule]] = {
    "multiple_choice": (("query", "choices", "gold"), "choice"),
    "schema": (("context_options", "continuation", "gold"), "choice"),
    "language_modeling": (("context", "continuation"), "greedy"),
    "generation_task_with_answers": (("context", "answer"), "generate"),
}
ALIASES = {"question_answering": "generation_task_with_answers"}
# The one metric computed per type (llm-foundry's default metric_names).
METRICS = {
    "multiple_choice": "InContextLearningMultipleChoiceAccuracy",
    "schema": "InContextLearningMultipleChoiceAccuracy",
    "language_modeling": "InContextLearningLMAccuracy",
    "generation_task_with_answers": "InContextLearningGenerationExactMatchAccuracy",
}
# Keys that only set how llm-foundry batches: accepted, unused.
BATCHING = ("batch_size",)
KEYS = (
    "label", "dataset_uri", "num_fewshot", "icl_task_type", "prompt_string",
    "example_delimiter", "continuation_delimiter", "prelimiter", "question_prelimiter",
    "has_categories", "fewshot_random_seed", "max_seq_len", "metric_names", "cot_delimiter",
    "early_stopping_criteria", "do_normalization", "generation_kwargs", *BATCHING,
)  # fmt: skip
# generation_kwargs that keep greedy decoding greedy; max_new_tokens sets the length.
GREEDY_KWARGS = {"do_sample": False, "num_beams": 1, "use_cache": None}


@dataclass(frozen=True)
class Options:
    """An entry's prompt and answer settings (llm-foundry's defaults)."""

    prompt_string: str = ""
    example_delimiter: str = "\n"
    continuation_delimiter: str = " "
    prelimiter: str = ""
    fewshot_random_seed: int = 1234
    max_seq_len: int | None = None
    cot_delimiter: str = ""
    early_stopping_criteria: tuple[str, ...] = ()
    do_normalization: bool = True
    max_new_tokens: int | None = None


@dataclass(frozen=True)
class FoundryTask:
    """One ``icl_tasks`` entry at one ``num_fewshot``, its file read (`load_icl_tasks`)."""

    label: str
    task_type: str
    num_fewshot: int
    rows: list[dict[str, Any]]
    options: Options = field(default_factory=Options)
    has_categories: bool = False

    @property
    def name(self) -> str:
        return f"{self.label}/{self.num_fewshot}-shot"

    def benchmark(self, shots: int) -> tuple[str, int]:
        return self.label, self.num_fewshot

    def check(self, tokenizer: Tokenizer, max_seq_len: int, shots: int) -> None:
        opts = self.options
        if opts.max_seq_len is not None and opts.max_seq_len > max_seq_len:
            raise UserError(
                f"icl task {self.name}: max_seq_len {opts.max_seq_len} is longer than the "
                f"model's {max_seq_len}; lower it or remove it"
            )
        if TYPES[self.task_type][1] == "generate" and tokenizer.eos_id is None:
            raise UserError(
                f"icl task {self.name}: generation stops at the end-of-text token, and this "
                "tokenizer has none (llm-foundry requires one too); use the model's tokenizer"
            )

    def prepare(
        self, tokenizer: Tokenizer, max_seq_len: int, shots: int, seed: int, limit: int | None
    ) -> Prepared:
        """The questions, prompted and tokenized as llm-foundry's dataset does (`shots` and
        `seed` are our .jsonl tasks'; this task has its own)."""
        self.check(tokenizer, max_seq_len, shots)
        opts, rule = self.options, TYPES[self.task_type][1]
        max_seq_len = opts.max_seq_len or max_seq_len
        n = len(self.rows) if limit is None else min(limit, len(self.rows))
        groups = _partition(self.rows) if self.has_categories else {"": list(range(len(self.rows)))}
        questions: dict[int, Question] = {}
        longest = 1
        for indices in groups.values():
            prompter = _Prompter(self, tokenizer, [self.rows[i] for i in indices], max_seq_len)
            longest = max(longest, prompter.max_answer_tokens)
            for local, shots_text in enumerate(prompter.shots()):
                if indices[local] < n:
                    questions[indices[local]] = prompter.question(local, shots_text)
        generation = None
        if rule == "generate":
            generation = Generation(
                opts.max_new_tokens or longest,
                opts.early_stopping_criteria,
                tokenizer.eos_id,
                _judge(opts.cot_delimiter, opts.do_normalization),
            )
        return Prepared(
            self.name, self.label, self.task_type, rule, self.num_fewshot,
            max_seq_len, [questions[i] for i in range(n)], generation,
            [str(self.rows[i]["category"]) for i in range(n)] if self.has_categories else None,
        )  # fmt: skip


def _partition(rows: list[dict[str, Any]]) -> dict[str, list[int]]:
    """Row indices by category, categories sorted (each is its own dataset in llm-foundry)."""
    groups: dict[Any, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(row["category"], []).append(i)
    return {str(k): groups[k] for k in sorted(groups)}


def fewshot_indices(size: int, shots: int, index: int, rng: random.Random) -> set[int]:
    """llm-foundry's draw of `index`'s shots among `size` examples: `shots` distinct indices
    (fewer when there are not enough others), one redrawn when the query itself is drawn. The
    set's iteration order is the order the shots are written in, as there."""
    shots = min(size - 1, shots)
    drawn = set(rng.sample(range(size), shots))
    if index not in drawn:
        return drawn
    drawn.discard(index)
    if len(drawn) >= size - 1:
        return drawn
    while (other := rng.choice(range(size))) in drawn or other == index:
        pass
    drawn.add(other)
    return drawn


class _Prompter:
    """One dataset's (a task's, or one category's) prompts and tokens."""

    def __init__(
        self, task: FoundryTask, tokenizer: Tokenizer, rows: list[dict[str, Any]], max_seq_len: int
    ) -> None:
        self.task, self.opts, self.tokenizer = task, task.options, tokenizer
        self.max_seq_len = max_seq_len
        self.rows = [
            {k: v.strip() if isinstance(v, str) else v for k, v in r.items()} for r in rows
        ]
        self.raw = rows
        # A BPE that reads " a" as one token wants the space before an answer (llm-foundry's
        # tokenizer_needs_prefix_space); SentencePiece adds its own.
        self.prefix_space = len(tokenizer.encode(" a", add_special_tokens=False)) == 1
        self.has_cot = any("chain_of_thought" in r for r in rows)
        self.max_answer_tokens = self._max_answer_tokens()

    def shots(self) -> list[str]:
        """Each query's prompt_string and shots, drawn in order from one generator."""
        rng = random.Random(self.opts.fewshot_random_seed)
        out = []
        for index in range(len(self.rows)):
            text = self.opts.prompt_string
            if self.task.num_fewshot > 0:
                for i in fewshot_indices(len(self.rows), self.task.num_fewshot, index, rng):
                    text += self._shot(self.rows[i], text)
            out.append(text)
        return out

    def _shot(self, row: dict[str, Any], before: str) -> str:
        o = self.opts
        lead = o.example_delimiter if before else ""
        if self.task.task_type == "schema":
            context = row["context_options"][row["gold"]]
            return f"{o.prelimiter}{lead}{context}{o.continuation_delimiter}{row['continuation']}"
        return f"{lead}{o.prelimiter}{row[self._context_key]}{o.continuation_delimiter}" + (
            self._answer_in_shot(row)
        )

    @property
    def _context_key(self) -> str:
        return "query" if self.task.task_type == "multiple_choice" else "context"

    def _answer_in_shot(self, row: dict[str, Any]) -> str:
        kind = self.task.task_type
        if kind == "multiple_choice":
            return row["choices"][row["gold"]]
        if kind == "language_modeling":
            return row["continuation"]
        if self.has_cot:
            return f"{row['chain_of_thought']}{self.opts.cot_delimiter}{row['answer']}"
        return row["answer"]

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _preamble(self, text: str) -> list[int]:
        """The prompt and shots with the tokenizer's special tokens, a trailing EOS dropped."""
        ids = self.tokenizer.encode(text, add_special_tokens=True)
        eos = self.tokenizer.eos_id
        return ids[:-1] if eos is not None and len(ids) > 1 and ids[-1] == eos else ids

    def _answer(self, text: str) -> list[int]:
        if self.prefix_space and not text.startswith(" "):
            text = " " + text
        return self._encode(text)

    def question(self, index: int, before: str) -> Question:
        row, o, kind = self.rows[index], self.opts, self.task.task_type
        preamble = self._preamble(before)
        if kind == "schema":
            delimiter = o.continuation_delimiter.rstrip()
            contexts = [
                f"{o.prelimiter}{o.example_delimiter}{c}{delimiter}" if before
                else f"{o.prelimiter}{c}"
                for c in row["context_options"]
            ]  # fmt: skip
            answer = self._answer(row["continuation"])
            choices = (Continuation(preamble + self._encode(c), answer) for c in contexts)
            return Question(tuple(choices), row["gold"])
        lead = o.example_delimiter if before else ""
        query = f"{lead}{o.prelimiter}{row[self._context_key]}{o.continuation_delimiter}"
        context = preamble + self._encode(query.rstrip())
        if kind == "multiple_choice":
            return Question(
                tuple(Continuation(context, self._answer(c)) for c in row["choices"]), row["gold"]
            )
        if kind == "language_modeling":
            return Question((Continuation(context, self._answer(row["continuation"])),))
        # llm-foundry leaves the longest answer's room after the prompt.
        keep = self.max_seq_len - self.max_answer_tokens
        if keep <= 0:
            raise UserError(
                f"icl task {self.task.name}: answers of {self.max_answer_tokens} tokens leave no "
                f"room for a prompt in max_seq_len={self.max_seq_len}"
            )
        raw = self.raw[index]
        answers = dict.fromkeys([raw["answer"], *raw.get("aliases", [])])
        return Question(prompt=tuple(context[-keep:]), answers=tuple(answers))

    def _max_answer_tokens(self) -> int:
        """llm-foundry's generation length: the most tokens (with special ones) of any answer
        or alias (after its chain of thought), + 10 with a cot_delimiter; at least 1."""
        if self.task.task_type != "generation_task_with_answers":
            return 0
        longest = 0
        for row in self.raw:
            for answer in [row["answer"], *row.get("aliases", [])]:
                if self.has_cot:
                    answer = f"{row['chain_of_thought']}{self.opts.cot_delimiter}{answer}"
                longest = max(longest, len(self.tokenizer.encode(answer)))
        return max(longest + (COT_ANSWER_BUFFER if self.opts.cot_delimiter else 0), 1)


_PUNCTUATION = set(string.punctuation + "‘’´`")


def normalize_answer(text: str) -> str:
    """llm-foundry's (and TriviaQA's) answer normalization: underscores to spaces, lower case,
    punctuation to spaces, articles removed, whitespace collapsed."""
    text = "".join(" " if ch in _PUNCTUATION else ch for ch in text.replace("_", " ").lower())
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def _judge(cot_delimiter: str, normalize: bool) -> Callable[[str, Sequence[str]], bool]:
    def judge(text: str, answers: Sequence[str]) -> bool:
        if cot_delimiter:
            text = text.split(cot_delimiter)[-1]
        clean = normalize_answer if normalize else str.strip
        return any(clean(text).startswith(clean(a)) for a in answers)

    return judge


def load_icl_tasks(source: str | Sequence[Mapping[str, Any]]) -> list[FoundryTask]:
    """The tasks of an ``icl_tasks`` YAML file (a mapping with the ``icl_tasks`` list, or the
    bare list; local or fsspec URL) or of the list itself, one per entry and ``num_fewshot``,
    their files read. A relative ``dataset_uri`` is read from the current directory, as
    llm-foundry reads it."""
    where = "icl_tasks"
    if isinstance(source, ListConfig):  # from a Hydra config (callbacks.icl_eval.icl_tasks)
        source = OmegaConf.to_container(source, resolve=True)
    if isinstance(source, str):
        where = source
        try:
            text = storage.read_small(source, MAX_YAML_BYTES).decode("utf-8", errors="replace")
        except FileNotFoundError:
            raise MissingInput(f"{source} does not exist; give an icl_tasks YAML") from None
        content = safe_load(text, source)
        if isinstance(content, dict):
            extra = sorted(set(content) - {"icl_tasks"})
            if extra or "icl_tasks" not in content:
                raise UserError(
                    f"{source}: an icl_tasks YAML holds the key icl_tasks alone"
                    + (f" (not {extra[0]!r})" if extra else "")
                    + ", or the bare list of tasks"
                )
            content = content["icl_tasks"]
        source = content
    if not isinstance(source, Sequence) or isinstance(source, str) or not source:
        raise UserError(f"{where}: icl_tasks must be a non-empty list of task entries")
    tasks = []
    for number, entry in enumerate(source):
        tasks += _entry_tasks(entry, f"{where}: icl_tasks[{number}]")
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise UserError(f"{where}: two tasks are named {twice}; give each entry its own label")
    return tasks


def _entry_tasks(entry: Any, where: str) -> list[FoundryTask]:
    if not isinstance(entry, Mapping):
        raise UserError(f"{where}: a task entry is a mapping of keys, got {type(entry).__name__}")
    entry = dict(entry)
    if isinstance(entry.get("label"), str):
        where = f"{where} ({entry['label']})"
    for key in ("label", "dataset_uri", "icl_task_type", "num_fewshot"):
        if key not in entry:
            raise UserError(f"{where}: {key} missing (llm-foundry requires it too)")
    task_type = ALIASES.get(entry["icl_task_type"], entry["icl_task_type"])
    if task_type == "code_evaluation":
        raise UserError(
            f"{where}: icl_task_type code_evaluation runs the model's code; not supported here "
            "(no code from a task runs); remove the entry"
        )
    if task_type not in TYPES:
        raise UserError(f"{where}: icl_task_type {task_type!r} is not one of {', '.join(TYPES)}")
    for key in entry:
        if key in ("hf_loading_vars", "hf_parsing_map"):
            raise UserError(f"{where}: {key} is for hf:// datasets, which are not read here")
        if key not in KEYS:
            raise UserError(f"{where}: unknown key {key!r}; the keys read here: {', '.join(KEYS)}")
    uri = _text(entry, "dataset_uri", where, None)
    if uri.startswith("hf://"):
        raise UserError(
            f"{where}: dataset_uri {uri} is on the Hugging Face Hub, not reached here; save the "
            "split as a .jsonl of llm-foundry's fields (datasets' Dataset.to_json) and give its path"
        )
    metrics = entry.get("metric_names", [METRICS[task_type]])
    if list(metrics) != [METRICS[task_type]]:
        raise UserError(
            f"{where}: metric_names {list(metrics)}: only {METRICS[task_type]} is computed for "
            f"{task_type} here; remove metric_names"
        )
    shots = entry["num_fewshot"]
    shots = shots if isinstance(shots, list) else [shots]
    if not shots or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in shots):
        raise UserError(f"{where}: num_fewshot must be a whole number >= 0 or a list of them")
    has_categories = _flag(entry, "has_categories", where, False)
    if has_categories and task_type == "generation_task_with_answers":
        raise UserError(
            f"{where}: has_categories with {task_type} is not supported here; split the file "
            "into one entry per category"
        )
    options = _options(entry, where)
    rows = _read_rows(uri, task_type, has_categories, where)
    label = _text(entry, "label", where, None)
    return [
        FoundryTask(label, task_type, n, rows, options, has_categories)
        for n in dict.fromkeys(shots)
    ]


def _text(entry: Mapping[str, Any], key: str, where: str, default: str | None) -> str:
    value = entry.get(key, default)
    if not isinstance(value, str):
        raise UserError(f"{where}: {key} must be a string, got {value!r}")
    return value


def _flag(entry: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    value = entry.get(key, default)
    if not isinstance(value, bool):
        raise UserError(f"{where}: {key} must be true or false, got {value!r}")
    return value


def _whole(entry: Mapping[str, Any], key: str, where: str) -> int | None:
    value = entry.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise UserError(f"{where}: {key} must be a whole number >= 1, got {value!r}")
    return value


def _options(entry: Mapping[str, Any], where: str) -> Options:
    if "prelimiter" in entry and "question_prelimiter" in entry:
        raise UserError(f"{where}: give prelimiter or question_prelimiter (the same), not both")
    prelimiter = entry.get("prelimiter", entry.get("question_prelimiter", ""))
    stops = entry.get("early_stopping_criteria") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise UserError(f"{where}: early_stopping_criteria must list non-empty strings")
    kwargs = dict(entry.get("generation_kwargs") or {})
    max_new_tokens = _whole(kwargs, "max_new_tokens", f"{where} generation_kwargs")
    kwargs.pop("max_new_tokens", None)
    for key, value in kwargs.items():
        if key not in GREEDY_KWARGS or GREEDY_KWARGS[key] not in (None, value):
            raise UserError(
                f"{where}: generation_kwargs {key}={value!r}: generation here is greedy; only "
                "max_new_tokens (and do_sample: false, num_beams: 1, use_cache) are read"
            )
    seed = entry.get("fewshot_random_seed", 1234)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise UserError(f"{where}: fewshot_random_seed must be a whole number, got {seed!r}")
    return Options(
        prompt_string=_text(entry, "prompt_string", where, ""),
        example_delimiter=_text(entry, "example_delimiter", where, "\n"),
        continuation_delimiter=_text(entry, "continuation_delimiter", where, " "),
        prelimiter=_text({"prelimiter": prelimiter}, "prelimiter", where, ""),
        fewshot_random_seed=seed,
        max_seq_len=_whole(entry, "max_seq_len", where),
        cot_delimiter=_text(entry, "cot_delimiter", where, ""),
        early_stopping_criteria=tuple(stops),
        do_normalization=_flag(entry, "do_normalization", where, True),
        max_new_tokens=max_new_tokens,
    )


def _read_rows(uri: str, task_type: str, has_categories: bool, where: str) -> list[dict[str, Any]]:
    required = TYPES[task_type][0] + (("category",) if has_categories else ())
    rows = []
    try:
        lines = list(read_jsonl(uri))
    except MissingInput:
        raise MissingInput(
            f"{where}: dataset_uri {uri} does not exist (a relative path is read from the "
            "current directory, as llm-foundry reads it)"
        ) from None
    for line, row in lines:
        missing = [k for k in required if k not in row]
        if missing:
            raise UserError(
                f"{line}: {task_type} lines need {list(required)}; {missing[0]!r} missing"
            )
        _check_row(row, task_type, line)
        rows.append(row)
    if not rows:
        raise UserError(f"{where}: {uri} holds no examples")
    cot = sum("chain_of_thought" in r for r in rows)
    if cot not in (0, len(rows)):
        raise UserError(f"{where}: {uri}: give chain_of_thought on every line or on none")
    return rows


def _check_row(row: dict[str, Any], task_type: str, line: str) -> None:
    """The fields' types, so a bad line is named here and not deep in the scoring."""
    options = {"multiple_choice": "choices", "schema": "context_options"}.get(task_type)
    if options is not None:
        choices, gold = row[options], row["gold"]
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
            raise UserError(f"{line}: {options!r} must list strings")
        if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices):
            raise UserError(f"{line}: 'gold' must index {options!r}, got {gold!r}")
    texts = [
        k for k in ("query", "context", "continuation", "answer", "chain_of_thought") if k in row
    ]
    if task_type == "schema":
        texts = ["continuation"]
    for key in texts:
        if not isinstance(row[key], str):
            raise UserError(f"{line}: {key!r} must be a string, got {type(row[key]).__name__}")
    aliases = row.get("aliases", [])
    if task_type == "generation_task_with_answers" and not (
        isinstance(aliases, list) and all(isinstance(a, str) for a in aliases)
    ):
        raise UserError(f"{line}: 'aliases' must list strings")


def load_tasks(urls: Sequence[str]) -> list[EvalTask]:
    """The tasks of each file: an llm-foundry ``icl_tasks`` YAML (.yaml, .yml) or one of our
    .jsonl tasks (anything else)."""
    tasks: list[EvalTask] = []
    for url in urls:
        if url.endswith((".yaml", ".yml")):
            tasks += load_icl_tasks(url)
        else:
            tasks.append(load_task(url))
    return tasks
