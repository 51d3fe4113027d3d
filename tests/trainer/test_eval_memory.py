"""Evaluation's memory: the metrics read the logits in their own dtype, chunk by chunk (no float32
copy of them: at 32 x 2048 x 50k that copy and cross-entropy's were 33 GB), and the trainer runs
each eval batch forward in microbatches, with the same metrics as whole batches."""

import functools
import weakref

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from llmfoundry.build import eval_microbatch_size
from llmfoundry.config import TrainSettings
from llmfoundry.core.metrics import SAMPLE_MASK, LanguageMetrics
from llmfoundry.distributed import SingleDevice
from llmfoundry.optim import DecoupledAdamW
from llmfoundry.trainer import Trainer
from llmfoundry.utils.errors import UserError
from tests.trainer.conftest import tiny_model


class PeakMemory(TorchDispatchMode):
    """Bytes of the storages that ops inside the mode allocate, while they live, and their peak.

    A storage first seen as an op's input (the logits handed in) counts nowhere; one an op
    returns that was never seen is new: it counts until it is freed (a finalizer on the storage,
    which torch keeps as one Python object per storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: weakref.WeakSet = weakref.WeakSet()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for tensor in tree_leaves((args, kwargs)):
            if isinstance(tensor, torch.Tensor):
                self._seen.add(tensor.untyped_storage())
        out = func(*args, **kwargs)
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._count(tensor.untyped_storage())
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        if storage in self._seen:
            return
        self._seen.add(storage)
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, storage.nbytes())

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes


def test_metrics_hold_at_most_a_fifth_of_the_bf16_logits_beside_them():
    """The issue's target: evaluation's peak per microbatch at most ~1.2x one bf16 logits tensor
    above the model, i.e. the metrics' own allocations at most 0.2x of it. Before: the float32
    copy of the logits (2x) and cross-entropy's float32 log-softmax (2x) at once."""
    batch, seq, vocab = 4, 512, 8192  # 32 MiB of bf16 logits; the CPU's chunk is 4 MiB
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, seq, vocab, generator=gen).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    metrics = LanguageMetrics(torch.device("cpu"))
    with PeakMemory() as memory:
        metrics.update(logits, {"labels": labels}, torch.ones(batch, dtype=torch.bool))
    logits_bytes = logits.numel() * logits.element_size()
    assert 0 < memory.peak <= 0.2 * logits_bytes, memory.peak / logits_bytes
    want = torch.nn.functional.cross_entropy(
        logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten()
    )
    assert metrics.compute()["loss"] == pytest.approx(want.item(), rel=1e-6)


def eval_batches() -> list[dict[str, torch.Tensor]]:
    """Two eval batches of 5 rows (not a multiple of the microbatches below), with ignored
    labels and rows whose sample_mask is False."""
    gen = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, 64, (5, 16), generator=gen)
        labels = ids.clone()
        labels[1, 4:9] = -100
        mask = torch.tensor([True, True, False, True, True])
        batches.append({"input_ids": ids, "labels": labels, SAMPLE_MASK: mask})
    return batches


def evaluate(tmp_path, microbatch: int | None) -> dict[str, float]:
    torch.manual_seed(0)
    trainer = Trainer(
        model=tiny_model(),
        strategy=SingleDevice("cpu"),
        train_dataloader=[],
        max_duration="1ba",
        optimizer=functools.partial(DecoupledAdamW, lr=1e-3),
        run_dir=tmp_path / str(microbatch),
        eval_dataloaders={"val": eval_batches()},
        device_eval_microbatch_size=microbatch,
    )
    try:
        return trainer.evaluate()
    finally:
        trainer.close()


def test_microbatched_evaluation_gives_the_metrics_of_whole_batches(tmp_path):
    """Loss sums are float64 sums of the tokens' float32 losses, so any grouping of the rows
    gives the same totals; the model's logits of a row do not depend on its microbatch here
    (fp32 on CPU), so the metrics are equal, not just close."""
    whole = evaluate(tmp_path, None)
    assert set(whole) == {"eval/val/loss", "eval/val/perplexity", "eval/val/accuracy"}
    for microbatch in (1, 2, 5):
        assert evaluate(tmp_path, microbatch) == whole, microbatch


def test_a_microbatch_size_below_one_is_refused(tmp_path):
    with pytest.raises(UserError, match="^device_eval_microbatch_size must be a positive"):
        evaluate(tmp_path, 0)


def settings(**overrides) -> TrainSettings:
    values = {"run_name": "x", "max_duration": "1ba", "global_train_batch_size": 64}
    return TrainSettings(**OmegaConf.to_container(OmegaConf.create({**values, **overrides})))


def test_eval_microbatches_default_to_what_a_training_step_fits():
    """conf/train.yaml's eval batch of 32 is split into the training microbatch (or the
    per-device train batch, auto-microbatching's first try), unless set."""
    assert eval_microbatch_size(settings(device_train_microbatch_size=4), 16) == 4
    assert eval_microbatch_size(settings(device_train_microbatch_size="auto"), 16) == 16
    assert eval_microbatch_size(settings(), 16) == 16
    explicit = settings(device_train_microbatch_size=4, device_eval_microbatch_size=2)
    assert eval_microbatch_size(explicit, 16) == 2
    with pytest.raises(ValueError, match="device_eval_microbatch_size must be a positive"):
        settings(device_eval_microbatch_size=0)


@pytest.mark.cuda
def test_on_the_gpu_the_metrics_hold_at_most_a_fifth_of_the_bf16_logits_beside_them():
    """The target measured by the allocator: 8 x 2048 x 50,368 bf16 logits (1.6 GB); before,
    the update allocated 4x that (the float32 copy and cross-entropy's float32 log-softmax)."""
    cuda = torch.device("cuda")
    gen = torch.Generator(cuda).manual_seed(0)
    logits = torch.randn(8, 2048, 50368, device=cuda, generator=gen).bfloat16()
    labels = torch.randint(0, 50368, (8, 2048), device=cuda, generator=gen)
    metrics = LanguageMetrics(cuda)
    everyone = torch.ones(8, dtype=torch.bool, device=cuda)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    metrics.update(logits, {"labels": labels}, everyone)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    assert peak <= 0.2 * logits.numel() * logits.element_size(), peak
    flat = logits[:, :-1].flatten(0, 1).float()
    want = torch.nn.functional.cross_entropy(flat, labels[:, 1:].flatten())
    assert metrics.compute()["loss"] == pytest.approx(want.item(), rel=1e-5)
