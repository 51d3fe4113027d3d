"""Bodies of the four-process mesh evaluation tests (spawned children import them by module
path): one spawn scores, evaluates and generates under every mesh in a row, a fresh process
group each; `one_process` computes the same on one process for the test to compare."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from llmfoundry.distributed import FSDP, SingleDevice, Strategy, unwrap_model
from llmfoundry.eval.forward import mesh_forward
from llmfoundry.eval.icl import Question, evaluate_tasks, load_task
from llmfoundry.eval.scoring import (
    Continuation,
    Forward,
    ModelForward,
    continue_prompts,
    greedy_continue,
    score_continuations,
)
from llmfoundry.models.generation import GenerationConfig, generate
from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM
from llmfoundry.tokenizers.tokenizer import prepare_tokenizer

from .spawn import join_env

WORLD = 4
# name -> the parallelism (mesh); every mesh is 4 processes (the rest of them data-parallel).
MESHES = {
    "tp2": {"tp": 2},
    "pp2": {"pp": 2},
    "tp2_pp2": {"tp": 2, "pp": 2},
    "fsdp": {},
    # Each rank's part of every row (padded to a multiple of 2 cp x tp), the logits gathered
    # over cp (under tp: each part's vocabulary gathered first).
    "cp2_tp2": {"cp": 2, "tp": 2},
    "cp2_pp2": {"cp": 2, "pp": 2},
}
SEED, VOCAB, MAX_SEQ_LEN = 3, 64, 64
# Continuations of odd and even lengths (tp=2 pads the odd ones, cp=2 all but multiples of
# 4), in batches of 2 rows and a last one of 1 (the pipeline pads rows too).
REQUESTS = [
    Continuation([1, 2, 3, 4, 5], [6, 7]),
    Continuation([9] * 11, [3]),
    Continuation([5, 4], [1, 2, 3]),
    Continuation(list(range(10, 40)), [40, 41, 42, 43]),
    Continuation([7], [8]),
]
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]]
GENERATIONS = {
    "greedy": GenerationConfig(max_new_tokens=6, temperature=0.0),
    "sampled": GenerationConfig(max_new_tokens=6, temperature=1.5, top_k=30, top_p=0.95, seed=7),
}
TASKS = ("mc", "lambada", "qa")


def tiny_mpt() -> MPTForCausalLM:
    """On meta (the strategy initializes it): 4 query and 2 key/value heads, so tp=2 splits
    both; 2 blocks, so pp=2 has one a stage."""
    config = MPTConfig(
        d_model=32, n_heads=4, kv_n_heads=2, n_layers=2, vocab_size=VOCAB, max_seq_len=MAX_SEQ_LEN,
        init_device="meta",
    )  # fmt: skip
    return MPTForCausalLM(config)


def prepared(strategy: Strategy) -> torch.nn.Module:
    """`tiny_mpt` as `strategy` prepares it, with one process's weights for `SEED` (every
    strategy initializes the whole tensors from the same generator state)."""
    torch.manual_seed(SEED)
    return strategy.prepare(tiny_mpt())


def write_tasks(folder: Path) -> None:
    """A word tokenizer (w0 ... w63) and a task of each kind in `folder`. The even examples'
    answers are what one process predicts (so they are right there), the odd ones' a fixed
    word (wrong there): a mesh must get both alike."""
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    words = lambda *ids: " ".join(f"w{i}" for i in ids)  # noqa: E731
    drafts = {
        "mc": [
            {
                "query": words(i, i + 1, i + 2),
                "choices": [f" w{i + 3}", " w9", " w30"],
                "gold": i % 3,
            }
            for i in range(2)
        ],
        "lambada": [{"context": words(*range(i, i + 6)), "continuation": " w1"} for i in range(2)],
        # One question: its answer is 32 tokens long (the random model never writes a newline).
        "qa": [{"question": "w5 w0", "answer": "w1"}],
    }
    model = unwrap_model(prepared(SingleDevice("cpu"))).eval()
    for name, examples in drafts.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in examples))
        task = load_task(str(folder / f"{name}.jsonl"))
        questions = task.prepare(_tokenizer(folder), MAX_SEQ_LEN, 0, 0, None).questions
        for index in range(0, len(examples), 2):
            answer = _one_process_answer(model, _tokenizer(folder), questions[index])
            if name == "mc":
                examples[index]["gold"] = answer
            elif name == "lambada":
                examples[index]["continuation"] = " " + tokenizer.decode(answer)
            else:
                examples[index]["answer"] = answer
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in examples))


def _one_process_answer(model: torch.nn.Module, tokenizer, question: Question) -> Any:
    """What one process answers: the chosen index (lowest mean loss), the predicted tokens of
    the one continuation, or the generated line."""
    forward = ModelForward(model)
    if not question.choices:
        line = lambda new: "\n" in tokenizer.decode(new)  # noqa: E731
        tokens = greedy_continue(forward, [question.prompt], 32, MAX_SEQ_LEN, line)[0]
        return tokenizer.decode(tokens).split("\n")[0].strip()
    if len(question.choices) > 1:
        losses = [s.mean_loss for s in score_continuations(forward, question.choices, MAX_SEQ_LEN)]
        return losses.index(min(losses))
    (choice,) = question.choices
    ids = torch.tensor([list(choice.context) + list(choice.continuation)])
    with torch.no_grad():
        logits = model(ids)[0]
    n = len(choice.continuation)
    return logits[-n - 1 : -1].argmax(dim=-1).tolist()


def _tokenizer(folder: Path):
    return prepare_tokenizer(str(folder / "tokenizer.json"), require_eos=False)


def _icl(model: torch.nn.Module, folder: Path, forward: Forward | None) -> dict[str, Any]:
    tasks = [load_task(str(folder / f"{name}.jsonl")) for name in TASKS]
    results = evaluate_tasks(unwrap_model(model), _tokenizer(folder), tasks, forward=forward)
    return {name: (r["accuracy"], r["scores"]) for name, r in results.items()}


def _scores(forward: Forward) -> list[tuple[float, bool]]:
    scored = score_continuations(forward, REQUESTS, MAX_SEQ_LEN, batch_size=2)
    return [(s.logprob, s.greedy) for s in scored]


def evaluation(model: torch.nn.Module, forward: Forward, folder: Path) -> dict[str, Any]:
    """What the tests compare between one process and each mesh."""
    result = {"scores": _scores(forward), "icl": _icl(model, folder, forward)}
    for name, config in GENERATIONS.items():
        result[name] = continue_prompts(forward, PROMPTS, config, MAX_SEQ_LEN)
    return result


def one_process(folder: Path) -> dict[str, Any]:
    """`evaluation` on one process, as before meshes could: generation by the KV-cached
    decoder (each prompt alone), the tasks scored without a `Forward`."""
    model = prepared(SingleDevice("cpu"))
    result = {"scores": _scores(ModelForward(model)), "icl": _icl(model, folder, None)}
    for name, config in GENERATIONS.items():
        result[name] = [generate(model, torch.tensor([p]), None, config).tokens[0] for p in PROMPTS]
    return result


def _fail(logits: torch.Tensor) -> torch.Tensor:
    raise ValueError("no token to draw")


def _failure(forward: Forward) -> str:
    """What each rank raises when the reduction fails where the logits are (a pipeline's
    last stage only; the others would wait for its result)."""
    try:
        forward(torch.ones(1, 3, dtype=torch.long), _fail)
    except Exception as err:
        return str(err)
    return ""


def rank_main(rank: int, world: int, ports: list[int], folder: str) -> None:
    result = {}
    for (name, options), port in zip(MESHES.items(), ports, strict=True):
        join_env(rank, world, port)
        strategy = FSDP("cpu", timeout_s=60, parallelism=options)
        strategy.setup()
        try:
            model = prepared(strategy)
            forward = mesh_forward(model, strategy)
            result[name] = evaluation(model, forward, Path(folder))
            result[name]["failure"] = _failure(forward)
        finally:
            strategy.teardown()
    torch.save(result, Path(folder) / f"rank{rank}.pt")
