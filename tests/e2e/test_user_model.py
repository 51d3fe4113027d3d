"""Your own nn.Module through train.py from the config (conf/model/custom.yaml): trained,
saved and resumed bitwise, sharded by FSDP on its named blocks, sampled without a KV cache."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llmfoundry.callbacks.generate import Generate
from llmfoundry.checkpoint.pretrained import read_pretrained
from llmfoundry.checkpoint.sharded import full_model_state
from llmfoundry.config import ConfigError
from llmfoundry.config.preflight import check
from llmfoundry.models.generation import GenerationConfig, generate_by_recompute
from llmfoundry.utils.errors import UserError
from tests.distributed.spawn import free_port, run_ranks

from .test_build import write_dataset
from .user_model import CONF, USER_MODEL, fsdp_rank, train, write_package

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tiny_gpt(tmp_path, monkeypatch):
    """The user's package, importable (as from PYTHONPATH)."""
    monkeypatch.syspath_prepend(str(write_package(tmp_path / "pkg")))
    monkeypatch.delitem(sys.modules, "tiny_gpt", raising=False)
    import tiny_gpt

    return tiny_gpt


def test_train_script_trains_a_module_from_pythonpath(tmp_path):
    """scripts/train.py model=custom model._target_=<your builder>, its arguments as +model.*:
    no MPT key reaches the builder, and the run saves a checkpoint."""
    package = write_package(tmp_path / "pkg")
    data = write_dataset(tmp_path / "data", 1)
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts/train.py"),
            *[arg if arg != "callbacks=[]" else "callbacks=[speed_monitor]" for arg in USER_MODEL],
            f"data.remote={data}",
            "max_duration=2ba",
            f"hydra.run.dir={tmp_path / 'run'}",
            f"save_folder={tmp_path / 'ckpt'}",
        ],  # fmt: skip
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": f"{ROOT}:{package}"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "ckpt" / "ep0-ba2").is_dir()
    # No flops_per_token: one line saying what to add (not Python's two-line UserWarning).
    said = [line for line in result.stderr.splitlines() if "flops_per_token" in line]
    assert len(said) == 1 and "def flops_per_token(self, seq_len: int)" in said[0], said


def test_a_builder_under_the_mpt_group_is_told_to_use_the_custom_group(tiny_gpt, tmp_path):
    data = write_dataset(tmp_path / "data", 1)
    with pytest.raises(ConfigError, match=r"use model=custom model._target_=tiny_gpt.build \("):
        check(CONF, ["model._target_=tiny_gpt.build", f"data.remote={data}"])


def test_save_and_resume_are_bitwise(tiny_gpt, tmp_path):
    """4 batches in one run equal 2, saved, then 2 more from that checkpoint."""
    data = write_dataset(tmp_path / "data", 1)
    common = [*USER_MODEL, f"data.remote={data}", "max_duration=4ba"]
    whole = train([*common, f"save_folder={tmp_path / 'a'}"], tmp_path / "r1")
    resumed = train(
        [*common, f"save_folder={tmp_path / 'b'}", f"load_path={tmp_path / 'a' / 'ep0-ba2'}"],
        tmp_path / "r2",
    )
    assert isinstance(whole.model, tiny_gpt.TinyGPT)
    expected = whole.model.state_dict()
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    # Scripts build no module named in a checkpoint; its weights load as the message says.
    with pytest.raises(UserError, match=r"holds your own module \(tiny_gpt.build\); scripts"):
        read_pretrained(str(tmp_path / "a" / "ep0-ba4"))
    model = tiny_gpt.build()
    model.load_state_dict(load_file(tmp_path / "a" / "ep0-ba4" / "model.safetensors"))
    assert torch.equal(model.head.weight, expected["head.weight"])


@pytest.mark.slow
def test_fsdp_shards_the_named_blocks_and_resumes_bitwise(tmp_path):
    write_package(tmp_path)
    write_dataset(tmp_path / "data", 1)
    run_ranks(fsdp_rank, 2, (free_port(), free_port()), str(tmp_path))
    assert torch.load(tmp_path / "units.pt") == [True, True]
    first = full_model_state(str(tmp_path / "ckpt" / "ep0-ba4" / "sharded"))
    resumed = full_model_state(str(tmp_path / "resumed" / "ep0-ba4" / "sharded"))
    assert first.keys() == resumed.keys()
    for name, value in resumed.items():
        assert torch.equal(value, first[name]), name


def test_sampling_recomputes_without_a_cache(tiny_gpt):
    """Greedy decoding through the training forward: each token the argmax of the logits of
    the whole sequence so far."""
    torch.manual_seed(0)
    model = tiny_gpt.build()
    tokens = generate_by_recompute(model, [3, 4], GenerationConfig(max_new_tokens=3, temperature=0))
    ids = [3, 4]
    for token in tokens:
        with torch.no_grad():
            assert token == int(model({"input_ids": torch.tensor([ids])})[0, -1].argmax())
        ids.append(token)
    assert len(tokens) == 3


class Letters:
    """A tokenizer of letters, id = letter index (the `Tokenizer` protocol, enough for one)."""

    eos_id = bos_id = None
    vocab_size = 26

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) - 97 for c in text]

    def encode_batch(self, texts):
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        return "".join(chr(97 + i % 26) for i in ids)

    def token_byte_lengths(self):
        return None


def test_generate_callback_samples_a_user_module_or_says_why_not(tiny_gpt, caplog):
    from types import SimpleNamespace

    from llmfoundry.distributed.single import SingleDevice

    state = lambda model: SimpleNamespace(model=model, strategy=SingleDevice("cpu"))  # noqa: E731
    callback = Generate(Letters(), ["ab"], max_new_tokens=2)
    with caplog.at_level(logging.INFO, logger="llmfoundry"):
        callback.fit_end(state(tiny_gpt.build()), None)
        assert "--- sample (prompt 'ab') ---" in caplog.text

        class Scalar(torch.nn.Linear):
            def forward(self, batch):
                return self.weight.sum()

        callback.fit_end(state(Scalar(1, 1)), None)
    assert "no samples, Scalar's forward(batch) returns no logits" in caplog.text
