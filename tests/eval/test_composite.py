"""Composites and intervals (llmfoundry/eval/composite.py): by hand, and through eval.py and the
icl_eval callback on a tiny model."""

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from llmfoundry.eval.composite import (
    Composites,
    bootstrap_accuracies,
    composite_report,
    parse_gauntlet,
    read_gauntlet,
    report_table,
)
from llmfoundry.utils.errors import UserError
from tests.eval.test_icl_eval import bpe, tiny_model, write


def result(correct: int, n: int, label: str | None = None, shots: int = 0) -> dict:
    scores = [1.0] * correct + [0.0] * (n - correct)
    r = {"kind": "multiple_choice", "accuracy": correct / n, "correct": correct}
    r |= {"examples": n, "shots": shots, "scores": scores}
    return r | ({"label": label} if label else {})


# arc 6/8 (baseline 0.25), qa 1/4 (0), copa 6/16 (0.5: below chance), piqa 2/2 (0.5), and mmlu
# split by category (a/0-shot 1/2 and b/0-shot 2/2 at 0.25), as llm-foundry's tasks with
# has_categories are: its accuracy is the mean of the two, 0.75, its size the sum, 4.
RESULTS = {
    "arc": result(6, 8),
    "qa": result(1, 4),
    "copa": result(6, 16),
    "piqa": result(2, 2),
    "mmlu/0-shot/a": result(1, 2, "mmlu"),
    "mmlu/0-shot/b": result(2, 2, "mmlu"),
}
ARC, QA, COPA, PIQA, MMLU = 2 / 3, 0.25, -0.25, 1.0, 2 / 3  # (a - b) / (1 - b)


def gauntlet(**options) -> dict:
    bench = lambda name, b: {"name": name, "num_fewshot": 0, "random_baseline": b}  # noqa: E731
    return {
        "eval_gauntlet": options
        | {
            "categories": [
                {"name": "knowledge", "benchmarks": [bench("arc", 0.25), bench("qa", 0)]},
                {"name": "reasoning", "benchmarks": [bench("copa", 0.5), bench("piqa", 0.5)]},
                {"name": "exams", "benchmarks": [bench("mmlu", 0.25)]},
            ]
        }
    }


AVERAGES = {"all": ["knowledge", "reasoning", "exams"], "two": ["knowledge", "reasoning"]}


@pytest.mark.parametrize(
    "options, knowledge, reasoning, exams",
    [
        # copa below chance counts negative (clipped at 0, reasoning would be 0.5)
        ({}, (ARC + QA) / 2, (COPA + PIQA) / 2, MMLU),
        ({"weighting": "SAMPLE_SZ"}, (ARC * 8 + QA * 4) / 12, (COPA * 16 + PIQA * 2) / 18, MMLU),
        # log2 of 8, 4, 16, and of 2 raised to llm-foundry's floor of 1
        ({"weighting": "LOG_SAMPLE_SZ"}, (ARC * 3 + QA * 2) / 5, (COPA * 4 + PIQA) / 5, MMLU),
        ({"rescale_accuracy": False}, (0.5 + 0.25) / 2, (-0.125 + 0.5) / 2, 0.5),
        (
            {"rescale_accuracy": False, "subtract_random_baseline": False},
            (0.75 + 0.25) / 2,
            (0.375 + 1.0) / 2,
            0.75,
        ),
    ],
)
def test_gauntlet_arithmetic_equals_a_hand_computation(options, knowledge, reasoning, exams):
    spec = gauntlet(**options, averages=AVERAGES)
    report = Composites.read(spec, None, resamples=0).report(RESULTS)["gauntlet"]
    scores = {k: e["score"] for part in ("categories", "averages") for k, e in report[part].items()}
    expected = {"knowledge": knowledge, "reasoning": reasoning, "exams": exams}
    # an average is the plain mean of its categories, whatever their benchmark counts
    expected |= {"all": (knowledge + reasoning + exams) / 3, "two": (knowledge + reasoning) / 2}
    assert scores == pytest.approx(expected, abs=1e-12)
    # without `averages:`, llm-foundry's one default_average of every category
    plain = Composites.read(gauntlet(**options), None, resamples=0).report(RESULTS)["gauntlet"]
    default = {"score": pytest.approx(expected["all"]), "ci95": None}
    assert plain["averages"] == {"default_average": default}


def test_core_is_the_mean_of_centered_accuracies():
    report = Composites.read(None, gauntlet(weighting="SAMPLE_SZ"), resamples=0).report(RESULTS)
    centered = {k: e["score"] for k, e in report["core"]["centered"].items()}
    assert centered == pytest.approx(
        {"arc/0-shot": ARC, "qa/0-shot": QA, "copa/0-shot": COPA, "piqa/0-shot": PIQA}
        | {"mmlu/0-shot": MMLU}
    )
    assert report["core"]["score"] == pytest.approx((ARC + QA + COPA + PIQA + MMLU) / 5)


def test_a_file_naming_results_that_are_missing_or_wrong_is_refused_in_one_line(tmp_path):
    partial = {k: v for k, v in RESULTS.items() if k != "piqa"}
    with pytest.raises(UserError, match=r"the gauntlet names piqa/0-shot, not among the tasks"):
        Composites.read(gauntlet(), None).report(partial)
    missing = r"names arc/0-shot, copa/0-shot, piqa/0-shot, mmlu/0-shot, not among the tasks "
    with pytest.raises(UserError, match=missing + r"scored \(arc/3-shot, qa/0-shot\)"):
        Composites.read(None, gauntlet()).check({("arc", 3), ("qa", 0)})
    bad = [
        ({"rescale_accuracy": True, "subtract_random_baseline": False}, "rescale_accuracy needs"),
        ({"weighting": "equal"}, "weighting 'equal' is not one of"),
        ({"averages": {"knowledge": ["reasoning"]}}, "average 'knowledge' is also a category"),
        ({"averages": {"x": ["reasonin"]}}, r"average 'x' names \['reasonin'\], not categories"),
        ({"weighted": "EQUAL"}, r"unknown \['weighted'\]"),
    ]
    for options, message in bad:
        with pytest.raises(UserError, match=message):
            parse_gauntlet(gauntlet(**options))
    twice = gauntlet()
    twice["eval_gauntlet"]["categories"][1]["benchmarks"].append(
        {"name": "arc", "num_fewshot": 0, "random_baseline": 0.2}
    )
    with pytest.raises(UserError, match="arc/0-shot is listed with random_baseline 0.25 and 0.2"):
        parse_gauntlet(twice)
    with pytest.raises(UserError, match="the bootstrap resamples must be a whole number >= 0"):
        Composites(resamples=-1)
    spec = gauntlet()
    spec["eval_gauntlet"]["categories"][0]["benchmarks"][0]["random_baseline"] = 25
    path = tmp_path / "g.yaml"
    path.write_text(json.dumps(spec))  # JSON is YAML
    with pytest.raises(UserError, match=r"g.yaml: eval_gauntlet: categories\[0\].benchmarks\[0\]"):
        read_gauntlet(str(path))


def test_bootstrap_is_seeded_and_matches_the_normal_approximation():
    p, n = 0.3, 400
    results = {"t": result(int(p * n), n), "u": result(3, 10)}
    a, b = bootstrap_accuracies(results, 2000, 1), bootstrap_accuracies(results, 2000, 1)
    assert all(np.array_equal(a[k], b[k]) for k in results)
    assert not np.array_equal(a["t"], bootstrap_accuracies(results, 2000, 2)["t"])
    # each task draws from its own seeded generator: another task does not move its interval
    assert np.array_equal(a["t"], bootstrap_accuracies({"t": results["t"]}, 2000, 1)["t"])
    low, high = composite_report(results, resamples=2000, seed=1)["tasks"]["t"]["ci95"]
    half = 1.96 * math.sqrt(p * (1 - p) / n)  # 0.0449
    assert low == pytest.approx(p - half, abs=0.01) and high == pytest.approx(p + half, abs=0.01)


def test_composite_intervals_come_from_the_same_replicates():
    report = composite_report(RESULTS, parse_gauntlet(gauntlet()), None, 500, 3)
    # one benchmark's category is an increasing affine map of its accuracy: so is its interval
    low, high = report["tasks"]["piqa"]["ci95"]
    g = report["gauntlet"]["benchmarks"]["piqa/0-shot"]["ci95"]
    assert g == pytest.approx([(low - 0.5) / 0.5, (high - 0.5) / 0.5])
    # a composite of several tasks carries all their noise: its interval is no point
    average = report["gauntlet"]["averages"]["default_average"]
    assert average["ci95"][0] < average["score"] < average["ci95"][1]
    table = report_table(RESULTS, report)
    assert "95% interval" in table and "default_average" in table


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from llmfoundry.checkpoint.pretrained import save_weights

    folder = tmp_path_factory.mktemp("composite")
    tokenizer = folder / "tokenizer.json"
    tokenizer.write_text(bpe().json)  # a few BPE merges: shared by the tests below
    save_weights(tiny_model(), str(folder / "ckpt"), tokenizer)
    mc = [{"query": "the cat", "choices": [" sat", " ran"], "gold": i % 2} for i in range(4)]
    lm = [{"context": "the cat sat on the", "continuation": " mat"}] * 2
    return folder, write(folder / "mc.jsonl", mc), write(folder / "lm.jsonl", lm)


def test_eval_script_prints_and_writes_intervals_and_composites(checkpoint, capsys):
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "eval.py"
    spec = importlib.util.spec_from_file_location("eval_script", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    folder, mc, lm = checkpoint
    bench = lambda name, b: {"name": name, "num_fewshot": 0, "random_baseline": b}  # noqa: E731
    spec = {"categories": [{"name": "all", "benchmarks": [bench("mc", 0.5), bench("lm", 0.0)]}]}
    (folder / "g.yaml").write_text(json.dumps({"eval_gauntlet": spec}))
    out = folder / "results.json"
    args = [str(folder / "ckpt"), mc, lm, "--gauntlet", str(folder / "g.yaml")]
    args += ["--core", str(folder / "g.yaml"), "--bootstrap", "200", "--out", str(out)]
    assert module.main(args) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    mc_result = report["tasks"]["mc"]
    assert mc_result["accuracy"] == 0.5 and len(mc_result["ci95"]) == 2  # one choice for all
    category = report["gauntlet"]["categories"]["all"]
    core = report["core"]
    assert core["score"] == pytest.approx(
        ((0.5 - 0.5) / 0.5 + report["tasks"]["lm"]["accuracy"]) / 2
    )
    assert category["score"] == pytest.approx(core["score"]) and report["bootstrap"]["seed"] == 0
    for name, entry in [("mc", mc_result), ("all", category), ("CORE", core)]:
        value = entry.get("accuracy", entry.get("score"))
        low, high = entry["ci95"]
        assert f"{value:.4f}  [{low:.4f}, {high:.4f}]" in printed, name
    # a gauntlet naming a task not given fails before any is scored
    (folder / "other.yaml").write_text(json.dumps(spec))
    with pytest.raises(SystemExit) as exited:
        module.main([str(folder / "ckpt"), mc, "--gauntlet", str(folder / "other.yaml")])
    assert exited.value.code == 2
    assert "names lm/0-shot, not among the tasks scored (mc/0-shot)" in capsys.readouterr().err


def test_callback_logs_the_composites(checkpoint):
    from llmfoundry.callbacks.icl_eval import ICLEval
    from llmfoundry.core.precision import Precision
    from llmfoundry.distributed.single import SingleDevice

    folder, mc, lm = checkpoint
    bench = lambda name, b: {"name": name, "num_fewshot": 0, "random_baseline": b}  # noqa: E731
    spec = {"categories": [{"name": "mc_only", "benchmarks": [bench("mc", 0.5)]}]}
    tokenizer = str(folder / "tokenizer.json")
    callback = ICLEval(tokenizer, [mc], limit=4, gauntlet=spec, core={"eval_gauntlet": spec})
    logged = {}
    logger = SimpleNamespace(log_metrics=logged.update)
    state = SimpleNamespace(
        model=tiny_model(),
        strategy=SingleDevice("cpu"),
        precision=Precision("fp32", torch.device("cpu")),
    )
    callback.eval_before_all(state, logger)
    accuracy = logged["icl/mc/accuracy"]
    assert logged == {
        "icl/mc/accuracy": accuracy,
        "icl/gauntlet/mc_only": (accuracy - 0.5) / 0.5,
        "icl/gauntlet/default_average": (accuracy - 0.5) / 0.5,
        "icl/core": (accuracy - 0.5) / 0.5,
    }
    with pytest.raises(UserError, match="names mc/0-shot"):
        ICLEval(tokenizer, [lm], gauntlet=spec)
