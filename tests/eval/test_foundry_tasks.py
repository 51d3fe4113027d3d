"""llm-foundry's icl_tasks (llmfoundry/eval/foundry_tasks.py): prompts written out by hand, each
task type scored by hand under a bigram "model", the YAML read and refused in one line, and the
tasks run through scripts/eval.py, the icl_eval callback and the train-YAML translator."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import types
from pathlib import Path

import pytest
import torch
import yaml

from llmfoundry.callbacks.icl_eval import ICLEval
from llmfoundry.core.precision import Precision
from llmfoundry.distributed import SingleDevice
from llmfoundry.eval import foundry_tasks
from llmfoundry.eval.foundry_tasks import fewshot_indices, load_icl_tasks, normalize_answer
from llmfoundry.eval.icl import evaluate_tasks
from tests.eval.test_icl_eval import bpe, tiny_model, word_tokenizer, write
from tests.test_tokenizer_protocol import EOS, ByteTokenizer

ROOT = Path(__file__).resolve().parents[2]


def bigram(table: torch.Tensor):
    """A `Forward` whose next-token logits depend only on the current token: table[token]."""
    return lambda ids, reduce: reduce(table[ids])


def entry(path, task_type: str, **options) -> dict:
    return {"label": Path(path).stem, "dataset_uri": str(path), "icl_task_type": task_type,
            "num_fewshot": [0], **options}  # fmt: skip


def prepared(tokenizer, rows, tmp_path, task_type, **options):
    """The one task of an entry over `rows`, prepared (tokenized with its shots)."""
    path = write(tmp_path / "task.jsonl", rows)
    [task] = load_icl_tasks([entry(path, task_type, **options)])
    return task.prepare(tokenizer, 64, 0, 0, None)


def nll(row: list[float], target: int) -> float:
    return math.log(sum(math.exp(v) for v in row)) - row[target]


def test_prompts_are_llm_foundrys_token_for_token(tmp_path):
    """Two examples, one shot: each one's shot is the other, written as llm-foundry writes it
    (shots with their answers, delimiters, the query's end stripped, answers on their own)."""
    text = ByteTokenizer().decode
    mc = [{"query": " q0 ", "choices": ["x", " y"], "gold": 1},
          {"query": "q1", "choices": ["z", "w"], "gold": 0}]  # fmt: skip
    opts = dict(num_fewshot=1, prompt_string="P", example_delimiter="|", prelimiter="Q:",
                continuation_delimiter=" => ")  # fmt: skip
    task = prepared(ByteTokenizer(), mc, tmp_path, "multiple_choice", **opts)
    first, second = task.questions
    assert [text(c.context) for c in first.choices] == ["P|Q:q1 => z|Q:q0 =>"] * 2
    assert [text(c.continuation) for c in first.choices] == ["x", " y"] and first.gold == 1
    assert text(second.choices[0].context) == "P|Q:q0 =>  y|Q:q1 =>"

    schema = [{"context_options": ["a b", "c"], "continuation": " d ", "gold": 0},
              {"context_options": ["e", "b"], "continuation": "c", "gold": 1}]  # fmt: skip
    zero = prepared(ByteTokenizer(), schema, tmp_path, "schema")
    assert [text(c.context) for c in zero.questions[0].choices] == ["a b", "c"]
    one = prepared(ByteTokenizer(), schema, tmp_path, "schema", num_fewshot=1)
    assert [text(c.context) for c in one.questions[0].choices] == ["b c\na b", "b c\nc"]
    assert text(one.questions[0].choices[0].continuation) == "d"

    qa = [{"context": "2+2?", "chain_of_thought": "add.", "answer": "4"},
          {"context": "1+1?", "chain_of_thought": "sum.", "answer": "2", "aliases": ["two"]}]  # fmt: skip
    cot = prepared(ByteTokenizer(), qa, tmp_path, "generation_task_with_answers", num_fewshot=1,
                   cot_delimiter=" So ", continuation_delimiter="\nA:", prelimiter="Q: ")  # fmt: skip
    assert text(cot.questions[0].prompt) == "Q: 1+1?\nA:sum. So 2\nQ: 2+2?\nA:"
    assert cot.questions[1].answers == ("2", "two")
    assert cot.generation.max_new_tokens == len("sum. So two") + 10  # + llm-foundry's cot room


def test_the_prompt_and_shots_carry_the_tokenizers_special_tokens_the_query_none(tmp_path):
    class BosBytes(ByteTokenizer):
        def encode(self, text, add_special_tokens=True):
            return [255] * add_special_tokens + super().encode(text)

    rows = [{"context": "ab", "continuation": "c"}] * 2
    zero = prepared(BosBytes(), rows, tmp_path, "language_modeling").questions[0].choices[0]
    assert list(zero.context) == [255, *b"ab"] and list(zero.continuation) == [*b"c"]
    one = prepared(BosBytes(), rows, tmp_path, "language_modeling", num_fewshot=1)
    assert list(one.questions[0].choices[0].context) == [255, *b"ab c\nab"]


def test_shots_are_drawn_as_llm_foundry_draws_them():
    # llm-foundry 0.22's get_fewshot_sample_idxs over random.Random(1234), examples in order.
    rng = random.Random(1234)
    drawn = [list(fewshot_indices(6, 2, i, rng)) for i in range(6)]
    assert drawn == [[3, 4], [0, 5], [0, 1], [0, 5], [0, 2], [3, 4]]
    rng = random.Random(5)
    assert [sorted(fewshot_indices(3, 5, i, rng)) for i in range(3)] == [[1, 2], [0, 2], [0, 1]]


def test_multiple_choice_takes_the_lowest_mean_loss_per_token(tmp_path):
    torch.manual_seed(0)
    table = torch.randn(5, 5)
    table[1, 2], table[1, 3], table[3, 3] = 3.0, 2.5, 6.0
    t = table.tolist()
    mean = {0: nll(t[1], 2), 1: (nll(t[1], 3) + nll(t[3], 3)) / 2}  # " c", " d d" after "a b"
    assert mean[1] < mean[0] and mean[0] < 2 * mean[1]  # the sum would pick " c"
    rows = [{"query": "a b", "choices": ["c", "d d"], "gold": g} for g in (0, 1)]
    task = write(tmp_path / "mc.jsonl", rows)
    got = evaluate_tasks(
        tiny_model(), word_tokenizer(), load_icl_tasks([entry(task, "multiple_choice")]),
        forward=bigram(table),
    )  # fmt: skip
    assert got["mc/0-shot"]["scores"] == [0.0, 1.0] and got["mc/0-shot"]["label"] == "mc"


def test_schema_ranks_the_contexts_by_the_continuations_loss(tmp_path):
    torch.manual_seed(1)
    table = torch.randn(5, 5)
    t = table.tolist()
    after = {ctx: nll(t[ctx], 2) + nll(t[2], 3) for ctx in (0, 1)}  # " c d" after "a" or "b"
    best = min(after, key=after.get)
    rows = [{"context_options": ["a", "b"], "continuation": "c d", "gold": g} for g in (0, 1)]
    task = write(tmp_path / "wsc.jsonl", rows)
    got = evaluate_tasks(
        tiny_model(), word_tokenizer(), load_icl_tasks([entry(task, "schema")]),
        forward=bigram(table),
    )  # fmt: skip
    assert got["wsc/0-shot"]["scores"] == [float(best == 0), float(best == 1)]


def test_language_modelling_is_all_greedy_with_categories(tmp_path):
    table = torch.zeros(5, 5)
    table[0, 1] = table[1, 2] = 1.0  # a -> b -> c
    rows = [{"context": "a", "continuation": "b c", "category": "x"},
            {"context": "a", "continuation": "b d", "category": "y"},
            {"context": "b", "continuation": "c", "category": "x"}]  # fmt: skip
    task = write(tmp_path / "lm.jsonl", rows)
    tasks = load_icl_tasks([entry(task, "language_modeling", has_categories=True)])
    got = evaluate_tasks(tiny_model(), word_tokenizer(), tasks, forward=bigram(table))
    assert {name: r["scores"] for name, r in got.items()} == {
        "lm/0-shot/x": [1.0, 1.0],  # llm-foundry's evaluators' labels: one per category
        "lm/0-shot/y": [0.0],
    }
    assert {(r["label"], r["shots"], r["category"]) for r in got.values()} == {
        ("lm", 0, "x"),
        ("lm", 0, "y"),
    }


def test_question_answering_cuts_at_stops_then_cot_and_prefix_matches_aliases(tmp_path):
    # Greedy from ":" writes " Paris!\nx" then EOS.
    table = torch.zeros(257, 257)
    chain = [ord(c) for c in ": Paris!\nx"] + [EOS]
    for a, b in zip(chain, chain[1:], strict=False):
        table[a, b] = 5.0
    model = tiny_model()

    def score(rows, **options):
        task = write(tmp_path / "qa.jsonl", [{"context": "Capital?:", **r} for r in rows])
        options.setdefault("generation_kwargs", {"max_new_tokens": 12})
        tasks = load_icl_tasks([entry(task, "generation_task_with_answers", **options)])
        return evaluate_tasks(model, ByteTokenizer(), tasks, forward=bigram(table))["qa/0-shot"]

    rows = [{"answer": "paris"}, {"answer": "London", "aliases": ["PAR"]}, {"answer": "Paris x"}]
    assert score(rows, early_stopping_criteria=["\n"])["scores"] == [1.0, 1.0, 0.0]
    assert score(rows)["scores"] == [1.0, 1.0, 1.0]  # no stop: " Paris!\nx" -> "paris x"
    exact = [{"answer": "Paris!"}, {"answer": "paris"}]
    got = score(exact, early_stopping_criteria=["\n"], do_normalization=False)
    assert got["scores"] == [1.0, 0.0]
    cot = [{"answer": "is"}, {"answer": "Paris"}]  # " Paris!" -> after the last "r": "is!"
    assert score(cot, early_stopping_criteria=["\n"], cot_delimiter="r")["scores"] == [1.0, 0.0]
    assert normalize_answer("The  Eiffel_Tower, an `icon`!") == "eiffel tower icon"


def test_the_yaml_gives_one_task_per_shot_count_with_paths_from_the_current_folder(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    write(tmp_path / "data" / "lm.jsonl", [{"context": "a", "continuation": "b"}] * 4)
    listed = [{"label": "lm", "dataset_uri": "data/lm.jsonl", "num_fewshot": [0, 2],
               "icl_task_type": "language_modeling", "batch_size": 4}]  # fmt: skip
    (tmp_path / "tasks.yaml").write_text(yaml.safe_dump({"icl_tasks": listed}))
    (tmp_path / "bare.yml").write_text(yaml.safe_dump(listed))
    for source in ("tasks.yaml", "bare.yml", listed):
        tasks = load_icl_tasks(source)
        assert [(t.name, t.num_fewshot, len(t.rows)) for t in tasks] == [
            ("lm/0-shot", 0, 4),
            ("lm/2-shot", 2, 4),
        ]
    monkeypatch.chdir(tmp_path / "data")
    with pytest.raises(FileNotFoundError, match="data/lm.jsonl does not exist.*current directory"):
        load_icl_tasks(str(tmp_path / "tasks.yaml"))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"shuffle": True}, r"icl_tasks\[0\] \(t\): unknown key 'shuffle'; the keys read here"),
        ({"icl_task_type": "code_evaluation"}, "code_evaluation runs the model's code"),
        ({"dataset_uri": "hf://org/set"}, "Hugging Face Hub.*Dataset.to_json"),
        ({"hf_loading_vars": {"split": "test"}}, "hf_loading_vars is for hf:// datasets"),
        ({"metric_names": ["InContextLearningMCExpectedCalibrationError"]}, "only InContextLea"),
        ({"has_categories": True}, "line 1: language_modeling lines need.*'category' missing"),
        ({"num_fewshot": [1, -1]}, "num_fewshot must be a whole number >= 0"),
        ({"generation_kwargs": {"temperature": 0.7}}, "generation_kwargs temperature=0.7"),
        ({"icl_task_type": "ranking"}, "icl_task_type 'ranking' is not one of"),
    ],
)
def test_entries_we_cannot_score_as_llm_foundry_does_are_refused_in_one_line(
    tmp_path, change, message
):
    path = write(tmp_path / "t.jsonl", [{"context": "a", "continuation": "b"}] * 2)
    with pytest.raises(ValueError, match=message) as err:
        load_icl_tasks([{**entry(path, "language_modeling"), **change}])
    assert "\n" not in str(err.value)


def test_a_yaml_file_is_read_bounded_and_holds_icl_tasks_alone(tmp_path, monkeypatch):
    path = write(tmp_path / "t.jsonl", [{"context": "a", "continuation": "b"}] * 2)
    tasks = tmp_path / "tasks.yaml"
    tasks.write_text(yaml.safe_dump({"icl_tasks": [entry(path, "language_modeling")], "x": 1}))
    with pytest.raises(ValueError, match="holds the key icl_tasks alone \\(not 'x'\\)"):
        load_icl_tasks(str(tasks))
    monkeypatch.setattr(foundry_tasks, "MAX_YAML_BYTES", 64)
    with pytest.raises(ValueError, match="larger than 64 bytes"):
        load_icl_tasks(str(tasks))


@pytest.fixture
def tasks_yaml(tmp_path) -> Path:
    mc = [{"query": "the cat", "choices": ["sat", "ran"], "gold": i % 2} for i in range(4)]
    lm = [{"context": "a dog ran to the", "continuation": w, "category": c}
          for w, c in (("park", "x"), ("mat", "y"), ("park", "y"))]  # fmt: skip
    listed = [
        entry(write(tmp_path / "mc.jsonl", mc), "multiple_choice", num_fewshot=[0, 1]),
        entry(write(tmp_path / "lm.jsonl", lm), "language_modeling", has_categories=True),
    ]
    path = tmp_path / "tasks.yaml"
    path.write_text(yaml.safe_dump({"icl_tasks": listed}))
    return path


def test_eval_script_scores_an_icl_tasks_yaml(tmp_path, tasks_yaml, capsys):
    from llmfoundry.checkpoint.pretrained import save_weights

    spec = importlib.util.spec_from_file_location("eval_script", ROOT / "scripts" / "eval.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(bpe().json)
    model = tiny_model()
    save_weights(model, str(tmp_path / "ckpt"), tokenizer)
    out = tmp_path / "results.json"
    gauntlet = tmp_path / "gauntlet.yaml"
    bench = {"name": "lm", "num_fewshot": 0, "random_baseline": 0.0}
    categories = [{"name": "lm_only", "benchmarks": [bench]}]
    gauntlet.write_text(yaml.safe_dump({"eval_gauntlet": {"categories": categories}}))
    argv = [str(tmp_path / "ckpt"), str(tasks_yaml), "--out", str(out), "--gauntlet", str(gauntlet)]
    assert module.main([*argv, "--bootstrap", "0"]) == 0
    written = json.loads(out.read_text())
    report = written["tasks"]
    by_category = [report[f"lm/0-shot/{c}"]["accuracy"] for c in ("x", "y")]
    # llm-foundry's gauntlet: a task's categories averaged, not its examples pooled
    assert written["gauntlet"]["categories"]["lm_only"]["score"] == sum(by_category) / 2
    assert list(report) == ["mc/0-shot", "mc/1-shot", "lm/0-shot/x", "lm/0-shot/y"]
    want = evaluate_tasks(model, bpe(), load_icl_tasks(str(tasks_yaml)))
    assert {k: {f: v for f, v in r.items() if f != "ci95"} for k, r in report.items()} == (
        json.loads(json.dumps(want))
    )
    assert "mc/1-shot" in capsys.readouterr().out


def test_the_callback_logs_each_task_and_category(tasks_yaml):
    logged = {}
    logger = types.SimpleNamespace(log_metrics=logged.update)
    callback = ICLEval(bpe(), icl_tasks=str(tasks_yaml), limit=None)
    state = types.SimpleNamespace(model=tiny_model(), strategy=SingleDevice("cpu"),
                                  precision=Precision("fp32", torch.device("cpu")))  # fmt: skip
    callback.eval_before_all(state, logger)
    assert set(logged) == {
        "icl/mc/0-shot/accuracy", "icl/mc/1-shot/accuracy", "icl/lm/0-shot/x/accuracy",
        "icl/lm/0-shot/y/accuracy",
    }  # fmt: skip
    with pytest.raises(ValueError, match="icl_eval has no tasks"):
        ICLEval(bpe())


def test_a_task_the_model_cannot_take_is_refused_before_any_is_scored(tmp_path):
    lm = write(tmp_path / "lm.jsonl", [{"context": "a", "continuation": "b"}] * 2)
    qa = write(tmp_path / "qa.jsonl", [{"context": "a", "answer": "b"}] * 2)
    calls = []

    def forward(ids, reduce):
        calls.append(ids)
        return reduce(torch.zeros(*ids.shape, 5))

    for bad, message in (
        (
            entry(lm, "language_modeling", label="long", max_seq_len=65),
            "longer than the model's 64",
        ),
        (entry(qa, "generation_task_with_answers"), "this tokenizer has none"),
    ):
        tasks = load_icl_tasks([entry(lm, "language_modeling"), bad])
        with pytest.raises(ValueError, match=message):
            evaluate_tasks(tiny_model(), word_tokenizer(), tasks, forward=forward)
    twice = load_icl_tasks([entry(lm, "language_modeling")]) * 2
    with pytest.raises(ValueError, match="two tasks are named lm/0-shot"):
        evaluate_tasks(tiny_model(), word_tokenizer(), twice, forward=forward)
    assert calls == []
