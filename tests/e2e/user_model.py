"""A tiny GPT of a user's own (README "Your own model"), written into a folder as a package
the tests put on the path, and one FSDP rank training it from the config (spawned children
import this module)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

TINY_GPT = """
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2)
                   for t in self.qkv(self.ln1(x)).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).flatten(2))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab_size: int, width: int, layers: int, max_seq_len: int) -> None:
        super().__init__()
        self.vocab_size, self.max_seq_len = vocab_size, max_seq_len
        self.wte, self.wpe = nn.Embedding(vocab_size, width), nn.Embedding(max_seq_len, width)
        self.blocks = nn.ModuleList(Block(width, 2) for _ in range(layers))
        self.head = nn.Linear(width, vocab_size)

    def forward(self, batch):
        ids = batch["input_ids"]
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def loss(self, logits, batch):
        labels = batch["labels"][:, 1:]
        total = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels.flatten(), reduction="sum")
        return total / (labels != -100).sum().clamp(min=1)


def build(vocab_size: int = 64, width: int = 32, layers: int = 2, max_seq_len: int = 16) -> TinyGPT:
    return TinyGPT(vocab_size, width, layers, max_seq_len)
"""

CONF = Path(__file__).resolve().parents[2] / "conf"
# The user module on a 64-token vocabulary and 16-token rows (tests.e2e.test_build's data).
USER_MODEL = [
    "model=custom", "model._target_=tiny_gpt.build", "+model.width=32",
    "model.fsdp_blocks=[tiny_gpt.Block]", "global_train_batch_size=4", "callbacks=[]",
    "loggers=[]", "save_interval=2ba", "scheduler.t_warmup=1ba",
]  # fmt: skip


def write_package(folder: Path) -> Path:
    """`folder` holding tiny_gpt.py (put it on the path to import it)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tiny_gpt.py").write_text(TINY_GPT)
    return folder


def train(overrides: list[str], run_dir: Path):
    """build_trainer on the composed config, fitted."""
    from llmfoundry.build import build_trainer
    from llmfoundry.config.preflight import compose_config

    return build_trainer(compose_config(CONF, overrides), run_dir).fit()


def fsdp_rank(rank: int, world: int, ports: tuple[int, int], folder: str) -> None:
    """Train 4 batches with FSDP saving shards at 2 and 4 (rank 0 records whether the blocks
    were FSDP units), then continue from the shards at 2 to 4: two runs in one spawn, each
    trainer with its own process group (the first is gone with its trainer; the second meets
    on a port of its own)."""
    from torch.distributed.fsdp import FSDPModule

    from llmfoundry.distributed import unwrap_model
    from tests.distributed.spawn import join_env

    join_env(rank, world, ports[0])
    sys.path.insert(0, folder)
    root = Path(folder)
    common = [*USER_MODEL, f"data.remote={root / 'data'}", "strategy=fsdp",
              "strategy.device=cpu", "max_duration=4ba"]  # fmt: skip
    model = unwrap_model(train([*common, f"save_folder={root / 'ckpt'}"], root / "run1").model)
    if rank == 0:
        torch.save([isinstance(block, FSDPModule) for block in model.blocks], root / "units.pt")
    join_env(rank, world, ports[1])
    load = f"load_path={root / 'ckpt' / 'ep0-ba2'}"
    train([*common, f"save_folder={root / 'resumed'}", load], root / "run2")
