"""A DataLoader whose batches the dataset makes whole, plus the trainer's resumption contract.

It serves any :class:`~llmfoundry.data.streaming.epochs.EpochDataset` (MDS shards, a token
file). Batches are made by ``dataset.make_batch(ids, positions)`` inside the loader's workers (or the main
process): a text dataset copies a batch of token rows straight out of the mapped shards, with
no per-sample decoding. Workers produce their rank's batches ``w, w+K, ...`` and PyTorch yields
them round-robin, so the batch order is the same for any ``num_workers`` (sampling.py).

Workers are not persistent: each iteration copies the dataset into fresh workers, which is how
``set_epoch`` and ``load_state_dict`` made in the main process reach them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from llmfoundry.data.streaming.checks import check_int
from llmfoundry.data.streaming.epochs import EpochDataset
from llmfoundry.utils.errors import UserError

__all__ = ["StreamingDataLoader"]


def _passthrough(batch: Any) -> Any:
    """The dataset's batches are final; skip the DataLoader's default conversion."""
    return batch


class _Batches(IterableDataset):
    """The dataset's batches as an iterable the DataLoader passes through unbatched."""

    def __init__(self, dataset: EpochDataset, drop_last: bool) -> None:
        self.dataset = dataset
        self.drop_last = drop_last

    def __iter__(self) -> Iterator[Any]:
        for ids, positions in self.dataset.batches():
            if self.drop_last and len(ids) < (self.dataset.batch_size or 1):
                return
            yield self.dataset.make_batch(ids, positions)

    def __len__(self) -> int:
        n = self.dataset.num_batches()
        short = len(self.dataset) % (self.dataset.batch_size or 1)
        return n - 1 if self.drop_last and short else n


class StreamingDataLoader(DataLoader):
    """DataLoader over an :class:`EpochDataset` (whose ``batch_size`` sets the batch size).

    Args:
        dataset: the dataset; its ``batch_size`` must be set.
        num_workers: worker processes making batches. Reads are memcpy-cheap gathers and
            downloads run on a background thread, so the main process keeps up with a GPU;
            workers help when batches need heavy decoding.
        pin_memory: page-locked batches, so the trainer's non_blocking copy to the GPU
            overlaps compute; None: exactly when CUDA is available.
        prefetch_factor, timeout: as for ``torch.utils.data.DataLoader`` (need workers).
        drop_last: skip a rank's final short batch (the epoch's last few samples).
    """

    def __init__(
        self,
        dataset: EpochDataset,
        *,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        prefetch_factor: int | None = None,
        drop_last: bool = False,
        timeout: float = 0,
    ) -> None:
        if dataset.batch_size is None:
            raise ValueError("StreamingDataLoader needs a dataset built with batch_size")
        check_int("num_workers", num_workers, minimum=0)
        check_int("prefetch_factor", prefetch_factor, minimum=1, optional=True)
        if prefetch_factor is not None and num_workers == 0:
            raise UserError("prefetch_factor needs num_workers > 0 (or set it to null)")
        if timeout and not num_workers:
            raise UserError("timeout limits the wait for worker batches; set num_workers > 0")
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        for name, value in (("pin_memory", pin_memory), ("drop_last", drop_last)):
            if not isinstance(value, bool):
                raise UserError(f"{name} must be true or false, got {value!r}")
        super().__init__(
            _Batches(dataset, drop_last),
            batch_size=None,
            collate_fn=_passthrough,
            num_workers=num_workers,
            pin_memory=pin_memory,
            prefetch_factor=prefetch_factor,
            timeout=timeout,
            persistent_workers=False,
        )
        self.streaming_dataset = dataset

    def __iter__(self) -> Iterator[Any]:
        """This epoch's batches.

        Made in this process (no workers, no pinning), they come straight from the dataset:
        torch's single-process iterator would add nothing to finished batches but a profiler
        ``record_function`` scope per batch, which costs ~30 us in a training loop (a fifth of
        reading a 64 x 2048-token batch; bench/data_loader.py). While a profiler runs, torch's
        iterator is used as usual, so traces keep its data-loading label.
        """
        if self.num_workers or self.pin_memory or torch.autograd._profiler_enabled():
            return super().__iter__()
        # torch's iterator draws its workers' base seed from the global RNG on every epoch; so
        # does this path, so the model's random stream is the same whichever path runs.
        torch.empty((), dtype=torch.int64).random_(generator=self.generator)
        return iter(self.dataset)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration reads; call before iterating each epoch."""
        self.streaming_dataset.set_epoch(epoch)

    def state_dict(self, num_samples: int, from_beginning: bool = True) -> dict[str, Any]:
        """The position after ``num_samples`` global samples (all ranks) of the current epoch."""
        return self.streaming_dataset.state_dict(num_samples, from_beginning)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume: the next iteration of the saved epoch yields exactly the remaining samples."""
        self.streaming_dataset.load_state_dict(state)
