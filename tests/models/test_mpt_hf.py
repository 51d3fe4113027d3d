"""Export to transformers' MptForCausalLM: same logits after the round trip, clear refusals."""

import pytest
import torch
import transformers
from safetensors import safe_open
from tokenizers import Tokenizer, models, pre_tokenizers

from llmfoundry.models import MPTConfig, MPTForCausalLM
from llmfoundry.models.mpt.hf import export_to_hf, to_hf_config

VOCAB = 120


def tiny(**overrides) -> MPTForCausalLM:
    fields = dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=40, vocab_size=VOCAB)
    fields.update(overrides)
    torch.manual_seed(0)
    return MPTForCausalLM(MPTConfig(**fields)).eval()


@pytest.mark.parametrize("n_heads", [4, 3])
@pytest.mark.parametrize(("clip_qkv", "softmax_scale"), [(None, None), (0.3, None), (None, 0.5)])
def test_round_trip_logits_match_transformers(tmp_path, n_heads, clip_qkv, softmax_scale):
    model = tiny(n_heads=n_heads, d_model=48, clip_qkv=clip_qkv, softmax_scale=softmax_scale)
    export_to_hf(model, tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    hf = transformers.MptForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, VOCAB, (2, 33))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)
    if clip_qkv is not None:  # the clip is really active at this scale
        unclipped = tiny(n_heads=n_heads, d_model=48)
        assert not torch.allclose(unclipped(ids), ours, atol=1e-3)


def test_export_with_dtype_and_tokenizer(tmp_path):
    model = tiny()
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    export_to_hf(model, tmp_path, tokenizer=tokenizer, dtype=torch.bfloat16)
    assert model.transformer.wte.weight.dtype == torch.float32  # the source is untouched
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert f.get_tensor("transformer.wte.weight").dtype == torch.bfloat16
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert loaded("w5 w17 w3")["input_ids"] == [5, 17, 3]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(qk_ln=True), "qk_ln=true"),
        (dict(alibi=False), "alibi=false"),
        (dict(no_bias=False), "no_bias=false"),
        (dict(expansion_ratio=2), "expansion_ratio=2"),
        (dict(alibi_bias_max=4), "alibi_bias_max=4"),
        (dict(kv_n_heads=2), "kv_n_heads=2"),
        (dict(sliding_window=8), "sliding_window=8"),
        (dict(infini=dict(segment_len=8)), "infini"),
    ],
)
def test_unsupported_features_are_refused(fields, message):
    cfg = MPTConfig(d_model=64, n_heads=4, n_layers=1, **fields)
    with pytest.raises(ValueError, match=f"cannot export.*{message}"):
        to_hf_config(cfg)


def test_meta_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match="meta device"):
        export_to_hf(tiny(init_device="meta"), tmp_path)
