import logging
import re
from pathlib import Path

import pytest
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers

from llmfoundry.callbacks import Generate
from llmfoundry.distributed import unwrap_model
from llmfoundry.models.generation import GenerationConfig, generate, left_pad
from tests.callbacks.conftest import make_trainer

ROOT = Path(__file__).resolve().parents[2]


def test_missing_tokenizer_names_the_fix(tmp_path):
    """The callbacks it suggests are the default list (conf/train.yaml) without generate: a run
    following the advice keeps its status file (`scripts/runs.py`)."""
    with pytest.raises(FileNotFoundError, match=r"set tokenizer=.*leave out the samples") as err:
        Generate(tokenizer=str(tmp_path / "tokenizer.json"), prompts=["def "])
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
