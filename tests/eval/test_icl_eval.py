"""ICL scoring (llmfoundry/eval/icl.py): by hand on a bigram table, and against transformers."""

import json
import math

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from llmfoundry.data.prep import PreparedTokenizer, train_bpe
from llmfoundry.eval.icl import _prefix, evaluate_tasks, load_task
from llmfoundry.eval.scoring import ModelForward
from llmfoundry.models.generation import GenerationConfig, generate
from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM
from llmfoundry.tokenizers.tokenizer import prepare

WORDS = ["a", "b", "c", "d", "e"]


def word_tokenizer() -> PreparedTokenizer:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return prepare(tok, require_eos=False)


def bigram(table: torch.Tensor):
    """A `Forward` whose next-token logits depend only on the current token: table[token]."""
    return lambda ids, reduce: reduce(table[ids])


def scores(table: torch.Tensor, task, shots: int = 0) -> list[float]:
    """Each example's score under the bigram `table` (the model only sets the vocabulary and
    context size; the bigram forward replaces it)."""
    results = evaluate_tasks(tiny_model(), word_tokenizer(), [task], shots, forward=bigram(table))
    return results[task.name]["scores"]


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def nll(row: list[float], target: int) -> float:
    return math.log(sum(math.exp(v) for v in row)) - row[target]


def test_multiple_choice_takes_the_lowest_mean_loss_per_token(tmp_path):
    torch.manual_seed(0)
    table = torch.randn(5, 5)
    table[1, 2] = 3.0  # b -> c likely: " c" is cheap per token
    table[1, 3], table[3, 3] = 2.5, 6.0  # b -> d fairly likely, d -> d very likely
    t = table.tolist()
    per_token = {0: nll(t[1], 2), 1: (nll(t[1], 3) + nll(t[3], 3)) / 2}  # choices after "a b"
    total = {0: per_token[0], 1: per_token[1] * 2}
    assert min(per_token, key=per_token.get) == 1 and min(total, key=total.get) == 0
    task = load_task(
        write(tmp_path / "mc.jsonl", [{"query": "a b", "choices": [" c", " d d"], "gold": 0}])
    )
    assert task.kind == "multiple_choice"
    assert scores(table, task) == [0.0]  # choice 1 picked


def test_language_modelling_needs_every_token_greedy(tmp_path):
    table = torch.zeros(5, 5)
    table[0, 1] = table[1, 2] = 1.0  # a -> b -> c
    task = load_task(
        write(
            tmp_path / "lm.jsonl",
            [{"context": "a", "continuation": " b c"}, {"context": "a", "continuation": " b d"}],
        )
    )
    assert scores(table, task) == [1.0, 0.0]


def test_shots_are_seeded_per_example_and_never_the_query(tmp_path):
    rows = [{"context": w, "continuation": " e"} for w in WORDS]
    task = load_task(write(tmp_path / "lm.jsonl", rows))
    for i, word in enumerate(WORDS):
        prefix = _prefix(task, i, 3, seed=1)
        assert prefix.count("\n\n") == 3 and f"{word} e\n\n" not in prefix
        assert prefix == _prefix(task, i, 3, seed=1)
    assert any(_prefix(task, i, 3, 1) != _prefix(task, i, 3, 2) for i in range(5))
    with pytest.raises(ValueError, match="too few for 5 shots"):
        _prefix(task, 0, 5, 1)


def test_a_task_too_short_for_the_shots_is_refused_before_any_is_scored(tmp_path):
    long = load_task(
        write(tmp_path / "long.jsonl", [{"context": w, "continuation": " e"} for w in WORDS])
    )
    short = load_task(write(tmp_path / "short.jsonl", [{"context": "a", "continuation": " b"}] * 2))
    calls = []

    def forward(ids, reduce):
        calls.append(ids)
        return reduce(torch.zeros(*ids.shape, len(WORDS)))

    with pytest.raises(
        ValueError, match="short has 2 examples, too few for 3 shots.*--shots 1 or fewer"
    ):
        evaluate_tasks(tiny_model(), word_tokenizer(), [long, short], 3, forward=forward)
    assert calls == []


def tiny_model() -> MPTForCausalLM:
    torch.manual_seed(0)
    return MPTForCausalLM(
        MPTConfig(d_model=32, n_heads=2, n_layers=2, max_seq_len=64, vocab_size=300)
    ).eval()


def bpe() -> PreparedTokenizer:
    return prepare(
        train_bpe(["the cat sat on the mat", "a dog ran to the park", "Q: A:"] * 30, 300)
    )


def test_qa_is_exact_match_on_the_greedy_line(tmp_path):
    model, tok = tiny_model(), bpe()
    prompt = tok.encode("Q: the cat\nA:")
    config = GenerationConfig(max_new_tokens=32, temperature=0.0, stop=("\n",))
    text = generate(model, torch.tensor([prompt]), None, config, decode=tok.decode).texts[0]
    task = load_task(
        write(
            tmp_path / "qa.jsonl",
            [
                {"question": "the cat", "answer": [text.strip(), "x"]},
                {"question": "the cat", "answer": "not it"},
            ],
        )
    )
    results = evaluate_tasks(model, tok, [task])
    assert results["qa"]["correct"] == 1 and results["qa"]["accuracy"] == 0.5


def test_same_choices_as_transformers_on_the_exported_model(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from llmfoundry.models.mpt.hf import export_to_hf

    model, tok = tiny_model(), bpe()
    export_to_hf(model, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    words = ["cat", "dog", "mat", "park", "the", "sat", "ran"]
    mc = [
        {"query": f"the {w} sat on", "choices": [f" the {x}" for x in words[:4]], "gold": i % 4}
        for i, w in enumerate(words)
    ]
    lm = [
        {"context": f"a {w} ran to the", "continuation": f" {x}"}
        for w in words
        for x in ("park", "mat")
    ]
    tasks = [
        load_task(write(tmp_path / "mc.jsonl", mc)),
        load_task(write(tmp_path / "lm.jsonl", lm)),
    ]

    def hf_forward(ids, reduce):
        with torch.no_grad():
            return reduce(hf(ids).logits)

    ours = evaluate_tasks(model, tok, tasks, 2, forward=ModelForward(model), batch_size=3)
    theirs = evaluate_tasks(model, tok, tasks, 2, forward=hf_forward, batch_size=5)
    assert ours == theirs
    assert 0 < sum(r["correct"] for r in ours.values()) < sum(len(t.examples) for t in tasks)


def test_bad_task_lines_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="line 1: cannot tell the task kind"):
        load_task(write(tmp_path / "x.jsonl", [{"text": "x"}]))
    with pytest.raises(ValueError, match="'gold' must index 'choices'"):
        load_task(write(tmp_path / "y.jsonl", [{"query": "q", "choices": ["a", "b"], "gold": 2}]))
    mixed = [{"context": "a", "continuation": "b"}, {"question": "q", "answer": "a"}]
    with pytest.raises(ValueError, match="line 2: a qa example in a language_modeling task"):
        load_task(write(tmp_path / "z.jsonl", mixed))


def test_callback_logs_accuracy_at_every_evaluation(tmp_path):
    from pathlib import Path

    from llmfoundry.build import build_trainer
    from llmfoundry.config.preflight import compose_config
    from tests.e2e.test_build import CONF, TINY, write_dataset

    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(word_tokenizer().json)
    task = write(tmp_path / "lm.jsonl", [{"context": "a", "continuation": " b"}] * 3)
    overrides = [
        *TINY,
        f"data.remote={write_dataset(tmp_path / 'mds', 1)}",
        f"tokenizer={tokenizer}",
        "callbacks=[icl_eval]",
        f"callbacks.icl_eval.tasks=[{task}]",
        "eval_interval=1ba",
    ]
    trainer = build_trainer(compose_config(Path(CONF), overrides), tmp_path / "run")
    logged = []
    trainer.logger.log_metrics = lambda metrics, *a: logged.append(dict(metrics))  # noqa: E731
    trainer.fit()
    accuracies = [m["icl/lm/accuracy"] for m in logged if "icl/lm/accuracy" in m]
    assert len(accuracies) == 3 and all(a in (0.0, 1.0) for a in accuracies)  # batches 0, 1, 2


def test_eval_script_scores_a_checkpoint_and_writes_json(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    from llmfoundry.checkpoint.pretrained import save_weights

    script = Path(__file__).resolve().parents[2] / "scripts" / "eval.py"
    spec = importlib.util.spec_from_file_location("eval_script", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(bpe().json)
    save_weights(tiny_model(), str(tmp_path / "ckpt"), tokenizer)
    mc = [{"query": "the cat", "choices": [" sat", " ran"], "gold": i % 2} for i in range(4)]
    task = write(tmp_path / "mc.jsonl", mc)
    out = tmp_path / "results.json"
    assert module.main([str(tmp_path / "ckpt"), task, "--shots", "0", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["tasks"]["mc"]["examples"] == 4 and report["shots"] == 0
    assert (
        report["tasks"]["mc"]["correct"] == 2
    )  # one prompt, so one choice: right for half the golds
    assert "mc" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        module.main([str(tmp_path / "ckpt"), str(tmp_path / "missing.jsonl")])
    assert exited.value.code == 2
