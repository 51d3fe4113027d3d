"""Three local lm-eval tasks (no hub: jsonl files through datasets' json builder) and the
comparison of two lm-eval runs on them, shared by the in-process tests (tests/eval/test_harness.py)
and the server's (tests/serving/test_server.py).

`MAX_LEN` is small so every kind of request is cut somewhere: multiple-choice contexts lose
their start and each perplexity text spans several rolling windows. lm-eval's API models count
their max_length differently (`api_max_length`); generation prompts stay uncut
(`check_prompts_fit`), where HFLM and the API models would keep different numbers of tokens.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

MAX_LEN = 16  # our max_seq_len and HFLM's max_length: each scores windows of MAX_LEN tokens
MAX_GEN = 6
TASKS = ["tiny_mc", "tiny_ppl", "tiny_gen"]

MC = [
    ("the quick brown fox jumps over the", [" fox", " dog", " lazy", " quick"]),
    ("hello world, hello", [" world", " server", " batch", " fox"]),
    ("import os\nimport", [" sys", " os", " add", " the"]),
    ("def add(a, b):\n    return a +", [" b", " a", " sys", " hello"]),
    ("the lazy", [" dog", " fox", " world", " return"]),
    ("hello server, hello", [" batch", " world", " server", " dog"]),
]
TEXTS = [
    "the quick brown fox jumps over the lazy dog and the lazy dog sleeps",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n",
    "hello world, hello server, hello batch, hello world again",
    "import os\nimport sys\nimport json\n",
]
PROMPTS = ["the quick brown", "hello world,", "import os\n", "def add(", "the lazy", "jumps over"]

YAML = {
    "tiny_mc": """output_type: multiple_choice
doc_to_text: "{{query}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{gold}}"
target_delimiter: ""
metric_list:
  - metric: acc
""",
    "tiny_ppl": """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""",
    "tiny_gen": f"""output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {MAX_GEN}
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


def write_tasks(folder: Path) -> Path:
    """The three tasks' jsonl files and YAMLs in `folder/tasks` (lm-eval's include_path)."""
    rows = {
        "tiny_mc": [{"query": q, "choices": c, "gold": i % 4} for i, (q, c) in enumerate(MC)],
        "tiny_ppl": [{"text": t} for t in TEXTS],
        # the answers: what a greedy tiny model is unlikely to write, and one it may ("")
        "tiny_gen": [{"prompt": p, "answer": " fox" if i else ""} for i, p in enumerate(PROMPTS)],
    }
    tasks = folder / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    for name, lines in rows.items():
        data = tasks / f"{name}.jsonl"
        data.write_text("".join(json.dumps(line) + "\n" for line in lines))
        head = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        head += f"    test: {data}\ntest_split: test\n"
        (tasks / f"{name}.yaml").write_text(head + YAML[name])
    return tasks


def check_prompts_fit(encode) -> None:
    """Generation prompts leave room for MAX_GEN new tokens (see the module docstring)."""
    assert all(len(encode(p)) <= MAX_LEN - MAX_GEN for p in PROMPTS)


def api_max_length() -> int:
    """The max_length that makes an API model cut as HFLM with MAX_LEN does: it sends at most
    max_length - 1 tokens, the last of them scored (HFLM: MAX_LEN + 1), and rolls windows of
    max_length - 2."""
    return MAX_LEN + 2


def evaluate(model: Any, tasks: Path, model_args: str | None = None) -> dict:
    """lm-eval's `simple_evaluate` on the three tasks, zero-shot, with every sample's responses
    (no stderr bootstrap); `model` an LM or a registered name with its `model_args`."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=TASKS,
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        num_fewshot=0,
        device="cpu",
        bootstrap_iters=0,
        log_samples=True,
    )


def skip_environment_report(monkeypatch) -> None:
    """`simple_evaluate`'s report of the environment (git, pip, torch's collect_env: seconds of
    subprocesses) is left out: it is not compared."""
    monkeypatch.setattr("lm_eval.evaluator.add_env_info", lambda results: None)
    monkeypatch.setattr("lm_eval.evaluator.get_git_commit_hash", lambda: None)


def summary(runs: dict[str, dict]) -> str:
    """A metric per line with each run's value, as lm-eval prints them."""
    lines = [" | ".join(["metric", *runs])]
    first = numbers(next(iter(runs.values())))
    for key in (k for k in first if " doc " not in k):
        lines.append(" | ".join([key, *(str(numbers(r)[key]) for r in runs.values())]))
    return "\n".join(lines)


def numbers(results: dict) -> dict[str, Any]:
    """Each task's metrics (lm-eval's printed values) and each sample's responses."""
    out: dict[str, Any] = {}
    for task in TASKS:
        metrics = results["results"][task]
        for key, value in metrics.items():
            if "," in key and not key.endswith("_stderr,none"):
                out[f"{task} {key}"] = value
        for sample in results["samples"][task]:
            out[f"{task} doc {sample['doc_id']}"] = sample["filtered_resps"]
    return out


def assert_same(ours: dict, theirs: dict, greedy: bool = True) -> None:
    """Equal accuracies and generations; log-likelihoods (and what follows from them) within
    1e-5. `greedy=False` leaves out whether each continuation was greedy (local-completions
    tells it from the top log-probability only)."""
    assert_same_numbers(numbers(ours), numbers(theirs), greedy)


def assert_same_numbers(a: dict[str, Any], b: dict[str, Any], greedy: bool = True) -> None:
    """`assert_same` of two runs' `numbers`."""
    assert a.keys() == b.keys()
    for key in a:
        if key.startswith("tiny_mc acc") or key.startswith("tiny_gen"):
            assert a[key] == b[key], (key, a[key], b[key])
        else:
            assert _close(a[key], b[key], greedy), (key, a[key], b[key])


def _close(x: Any, y: Any, greedy: bool) -> bool:
    if isinstance(x, list | tuple):
        pairs = zip(x, y, strict=True)
        if not greedy and len(x) == 2 and isinstance(x[1], bool):
            pairs = [(x[0], y[0])]
        return len(x) == len(y) and all(_close(p, q, greedy) for p, q in pairs)
    if isinstance(x, float) and isinstance(y, float):
        return math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-5)
    return x == y
