"""MPT with the options llm-foundry's Llama-like configs use (RoPE, RMSNorm, a GLU, an untied
output head): trained through scripts/train.py's overrides, counted right, refused by name
where transformers' MptForCausalLM cannot hold them. Parity with llm-foundry's own logits:
test_mpt_foundry_folders.py (gqa-rope, variants); decoding: test_generation.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmfoundry.checkpoint.pretrained import load_pretrained
from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM
from llmfoundry.models.mpt.hf import to_hf_config
from llmfoundry.models.mpt.spec import MPT
from llmfoundry.utils.errors import UserError
from tests.checkpoint.helpers import write_mds

ROOT = Path(__file__).resolve().parents[2]
LLAMA_LIKE = dict(
    alibi=False, rope=True, norm_type="rmsnorm", ffn_type="glu", ffn_act="silu",
    tie_word_embeddings=False,
)  # fmt: skip
TINY = dict(d_model=32, n_heads=4, n_layers=2, max_seq_len=16, vocab_size=64)


def test_train_script_trains_it_from_overrides(tmp_path):
    mds = write_mds(tmp_path / "mds", {"train": 12, "val": 4})
    save = tmp_path / "ckpt"
    overrides = [f"model.{key}={str(value).lower()}" for key, value in LLAMA_LIKE.items()]
    command = [
        sys.executable, str(ROOT / "scripts" / "train.py"), "run_name=llama-like",
        f"data.remote={mds}", "data.shuffle_block_size=8", "model.d_model=32",
        "model.n_heads=2", "model.n_layers=1", "model.max_seq_len=16", "model.vocab_size=64",
        *overrides, "global_train_batch_size=4", "max_duration=3ba", "scheduler.t_warmup=1ba",
        "eval_interval=3ba", "eval_first=false", "eval_subset_num_batches=1", f"save_folder={save}", "save_interval=3ba",
        "callbacks=[]", "loggers=[console]",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    model, _ = load_pretrained(str(save))
    assert model.config.rope and model.config.norm_type == "rmsnorm"
    assert model.config.ffn_type == "glu" and not model.config.tie_word_embeddings
    names = set(model.state_dict())
    assert {"lm_head.weight", "transformer.blocks.0.ffn.gate_proj.weight"} <= names
    assert not torch.equal(model.lm_head.weight, model.transformer.wte.weight)


def test_params_flops_and_activation_bytes_count_the_gate_and_the_head():
    plain = MPTForCausalLM(MPTConfig(**TINY))
    model = MPTForCausalLM(MPTConfig(**TINY, **LLAMA_LIKE))
    d, hidden, vocab = 32, 128, 64
    # A gate per block; the head's own matrix; RMSNorm has no bias (plain MPT: no_bias too).
    assert model.num_params() - plain.num_params() == 2 * d * hidden + vocab * d
    assert model.num_params(exclude_embeddings=True) == model.num_params() - vocab * d
    assert model.flops_per_token(16) - plain.flops_per_token(16) == 6 * 2 * d * hidden
    assert MPT.activation_bytes(model.config, "fp32") == (68 + 32) * d


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("rope", True),
        ("norm_type", "rmsnorm"),
        ("ffn_type", "glu"),
        ("tie_word_embeddings", False),
    ],
)
def test_export_to_transformers_refuses_each_by_name(field, value):
    fields = {**TINY, field: value, **({"alibi": False} if field == "rope" else {})}
    with pytest.raises(UserError, match=f"(support: |; ){field}="):
        to_hf_config(MPTConfig(**fields))


def test_rope_packed_documents_match_each_alone():
    """Positions restart per document (`sequence_id`): the second document's logits equal
    its own forward."""
    torch.manual_seed(0)
    model = MPTForCausalLM(MPTConfig(**TINY, **LLAMA_LIKE)).eval()
    ids = torch.randint(0, 64, (1, 12))
    sequence_id = torch.tensor([[0] * 5 + [1] * 7])
    with torch.no_grad():
        packed = model(ids, sequence_id)[:, 5:]
        alone = model(ids[:, 5:])
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)
