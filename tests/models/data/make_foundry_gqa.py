"""Build tests/models/data/foundry-gqa/ with the real llm-foundry, by hand (never in CI):

    /work/foundry-venv/bin/python tests/models/data/make_foundry_gqa.py

(llm-foundry 0.22.0, transformers 4.51.3, torch 2.7.0 CPU.) An llm-foundry MPTForCausalLM with
what tests/fixtures/foundry/ has no rope-free fixture of: grouped-query attention (kv_n_heads 2
of 4), qk_ln, clip_qkv, a sliding window, biases, plain LayerNorm and an MLP of
ffn_hidden_size 64 (2 * d_model), its random weights' biases and norms moved off their init.
Saved as convert_composer_to_hf.py saves (save_pretrained with auto_map; the remote code files
it copies are deleted, not committed), with reference-logits.safetensors: input_ids [2, 24]
and llm-foundry's own fp32 logits for them.
"""

import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

OUT = Path(__file__).resolve().parent / "foundry-gqa"

warnings.filterwarnings("ignore")
torch.manual_seed(0)
config = MPTConfig(
    d_model=32,
    n_heads=4,
    n_layers=2,
    max_seq_len=32,
    vocab_size=64,
    norm_type="layernorm",
    ffn_config={"ffn_type": "mptmlp", "ffn_hidden_size": 64},
    attn_config={
        "attn_impl": "torch",
        "attn_type": "grouped_query_attention",
        "kv_n_heads": 2,
        "qk_ln": True,
        "clip_qkv": 3.0,
        "sliding_window_size": 5,
    },
)
MPTConfig.register_for_auto_class()
MPTForCausalLM.register_for_auto_class("AutoModelForCausalLM")
model = MPTForCausalLM(config).eval()
with torch.no_grad():
    for name, param in model.named_parameters():
        if "norm" in name or "_ln" in name or name.endswith("bias"):
            param.add_(torch.randn_like(param) * 0.1)
model.save_pretrained(OUT)
for code in OUT.glob("*.py"):
    code.unlink()
ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    logits = model(ids).logits.contiguous()
save_file({"input_ids": ids, "logits": logits}, OUT / "reference-logits.safetensors")
print(sorted(p.name for p in OUT.iterdir()))
