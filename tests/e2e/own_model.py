"""The README's "Your own model" adapter, loaded from the README itself, and one DDP rank
training it (spawned children import this module by path)."""

from __future__ import annotations

import functools
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import torch

from llmfoundry.algorithms import GradientClipping
from llmfoundry.callbacks import LRMonitor, NaNDetector, SpeedMonitor
from llmfoundry.distributed import DDP, Strategy, unwrap_model
from llmfoundry.loggers import JSONLLogger
from llmfoundry.trainer import Trainer
from tests.distributed.spawn import join_env
from tests.distributed.workers import global_batches, rank_slice

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_module(folder: Path) -> ModuleType:
    """``my_model.py`` exactly as the README shows it, saved in `folder` and imported."""
    section = README.read_text().split("### Your own model", 1)[1]
    code = re.search(r"```python\n(# my_model\.py\n.*?)```", section, re.S).group(1)
    path = Path(folder) / "my_model.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location("my_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["my_model"] = module
    spec.loader.exec_module(module)
    return module


def train(folder: Path, strategy: Strategy, batches: list, **kwargs) -> Trainer:
    """The README's tiny Llama, with algorithms, callbacks and a logger, on `batches`."""
    torch.manual_seed(0)  # the model is built before the Trainer: the same weights everywhere
    model = readme_module(folder).tiny_llama()
    trainer = Trainer(
        model=model,
        strategy=strategy,
        train_dataloader=batches,
        max_duration=f"{len(batches)}ba",
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        run_dir=folder,
        algorithms=[GradientClipping(threshold=1e3)],
        callbacks=[NaNDetector(), LRMonitor(), SpeedMonitor(peak_flops=1e12)],
        loggers=[JSONLLogger()],
        **kwargs,
    )
    trainer.fit()
    return trainer


def ddp_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    join_env(rank, world, port)
    folder = Path(out_dir) / f"rank{rank}"
    folder.mkdir()
    batches = rank_slice(global_batches(), rank, world)
    state = train(folder, DDP(device="cpu", timeout_s=60), batches).state
    params = {n: p.detach().clone() for n, p in unwrap_model(state.model).named_parameters()}
    torch.save(
        {"params": params, "train_loss": torch.tensor(state.train_loss, dtype=torch.float64)},
        Path(out_dir) / f"rank{rank}.pt",
    )


__all__ = ["ddp_rank", "readme_module", "train"]
