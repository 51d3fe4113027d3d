import ast
import functools
import logging
import re
from pathlib import Path

import pytest
import torch
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers

from llmfoundry.callbacks import Generate
from llmfoundry.data.prep import train_bpe
from llmfoundry.data.prep.instructions import Formatter
from llmfoundry.distributed import SingleDevice, unwrap_model
from llmfoundry.models.generation import GenerationConfig, generate, left_pad
from llmfoundry.trainer import Trainer
from llmfoundry.utils.errors import UserError
from tests.callbacks.conftest import make_trainer
from tests.trainer.conftest import tiny_model

ROOT = Path(__file__).resolve().parents[2]


def test_missing_tokenizer_names_the_fix(tmp_path):
    """Data that does not say it has no tokenizer: a missing one is a wrong path, refused when
    the run starts. The callbacks it suggests are the default list (conf/train.yaml) without
    generate: a run following the advice keeps its status file (`scripts/runs.py`)."""
    callback = Generate(tokenizer=str(tmp_path / "tokenizer.json"), prompts=["def "])
    with pytest.raises(FileNotFoundError, match=r"set tokenizer=.*leave out the samples") as err:
        make_trainer(tmp_path, n_batches=1, callbacks=[callback])
    defaults = yaml.safe_load((ROOT / "conf/train.yaml").read_text())["defaults"]
    default = next(d["callbacks"] for d in defaults if isinstance(d, dict) and "callbacks" in d)
    suggested = re.search(r"callbacks=\[([^]]*)\]", str(err.value))[1].split(",")
    assert suggested == [c for c in default if c != "generate"]


def test_logs_each_prompt_continued_by_the_generation_function(tmp_path, caplog):
    vocab = {f"w{i}": i for i in range(64)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    prompts = ["w1 w2 w3", "w5"]
    callback = Generate(str(tmp_path / "tokenizer.json"), prompts, max_new_tokens=4, temperature=0)
    trainer = make_trainer(tmp_path, n_batches=1, callbacks=[callback])
    with caplog.at_level(logging.INFO, logger="llmfoundry.callbacks.generate"):
        trainer.fit()
    logged = "\n".join(r.getMessage() for r in caplog.records) + "\n"
    ids, mask = left_pad([[1, 2, 3], [5]])
    model = unwrap_model(trainer.state.model)
    out = generate(model, ids, mask, GenerationConfig(max_new_tokens=4, temperature=0))
    for prompt, tokens in zip(prompts, out.tokens, strict=True):
        assert f"--- sample (prompt {prompt!r}) ---\n{prompt}{tokenizer.decode(tokens)}\n" in logged


VIM_DOC = (
    "*usr_01.txt* For Vim version 9.1 . Last change : 2024 May 05 VIM USER MANUAL by Bram "
    "Moolenaar About the manuals : This chapter introduces the manuals available with Vim ."
)


def _word_tokenizer(text: str) -> Tokenizer:
    words = list(dict.fromkeys(text.split()))
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


def _sample_prompts(caplog) -> list[str]:
    """The prompts of the logged samples (logged as their repr)."""
    return [
        ast.literal_eval(p) for p in re.findall(r"--- sample \(prompt (.*?)\) ---", caplog.text)
    ]


def test_prompts_with_the_start_of_a_validation_row_not_code(tmp_path, caplog):
    """Vim docs: the sample continues the start of a validation row; 'def ' only without one."""
    tokenizer = _word_tokenizer(VIM_DOC)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    ids = torch.tensor([tokenizer.encode(VIM_DOC).ids[:16]] * 2)
    val = [{"input_ids": ids, "labels": ids.clone()}]
    callback = Generate(str(tmp_path / "tokenizer.json"), max_new_tokens=2, prompt_tokens=6)
    trainer = make_trainer(
        tmp_path, n_batches=1, callbacks=[callback], eval_dataloaders={"val": val}
    )
    with caplog.at_level(logging.INFO, logger="llmfoundry.callbacks.generate"):
        trainer.fit()
    assert _sample_prompts(caplog) == [" ".join(VIM_DOC.split()[:6])]
    caplog.clear()
    callback = Generate(str(tmp_path / "tokenizer.json"), max_new_tokens=2)
    trainer = make_trainer(tmp_path / "no-val", n_batches=1, callbacks=[callback])
    with caplog.at_level(logging.INFO, logger="llmfoundry.callbacks.generate"):
        trainer.fit()
    assert _sample_prompts(caplog) == ["def "] and "no validation batch was seen" in caplog.text


def test_prompts_instruction_data_in_its_finetune_format(tmp_path, caplog):
    """Instruction rows: the prompt is the untrained text before the first response token."""
    texts = ["### User:\nWhat does :wq do?\n\n### Assistant:\nWrite and quit.\n"] * 20
    (tmp_path / "tokenizer.json").write_text(train_bpe(texts, vocab_size=300).to_str())
    formatter = Formatter(str(tmp_path / "tokenizer.json"))
    messages = [
        {"role": "user", "content": "What does :wq do?"},
        {"role": "assistant", "content": "Write and quit."},
    ]
    ids, labels = (torch.from_numpy(a.astype("int64"))[None] for a in formatter.encode(messages))
    batches = [{"input_ids": ids, "labels": labels}]
    callback = Generate(str(tmp_path / "tokenizer.json"), max_new_tokens=2)
    trainer = Trainer(
        model=tiny_model(vocab_size=300, seq_len=ids.shape[1] + 4),
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        run_dir=tmp_path,
        train_dataloader=batches,
        eval_dataloaders={"val": batches},
        max_duration="1ba",
        callbacks=[callback],
    )
    with caplog.at_level(logging.INFO, logger="llmfoundry.callbacks.generate"):
        trainer.fit()
    assert _sample_prompts(caplog) == ["### User:\nWhat does :wq do?\n\n### Assistant:\n"]
    assert formatter.prompt(messages) == "### User:\nWhat does :wq do?\n\n### Assistant:\n"


class _TensorParallel(SingleDevice):
    """A strategy that says it splits the model (nothing runs before the refusal)."""

    tp = 2


def test_sampling_without_a_seed_under_tensor_parallelism_is_refused_at_start(tmp_path):
    """On a mesh every process draws the samples from its own generator: without a seed they
    would disagree on the tokens (and feed different ids to one split forward)."""
    tokenizer = _word_tokenizer(VIM_DOC)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    unseeded = Generate(str(tmp_path / "tokenizer.json"), ["Vim"], seed=None)
    with pytest.raises(UserError, match=r"callbacks.generate.seed=null under strategy.tp, "):
        make_trainer(tmp_path, n_batches=1, strategy=_TensorParallel("cpu"), callbacks=[unseeded])
    greedy = Generate(str(tmp_path / "tokenizer.json"), ["Vim"], temperature=0, seed=None)
    make_trainer(tmp_path, n_batches=1, strategy=_TensorParallel("cpu"), callbacks=[greedy])
