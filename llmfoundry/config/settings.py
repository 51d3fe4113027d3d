"""The top-level keys of `conf/train.yaml`; config groups are validated by their `_target_`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from llmfoundry.trainer.time import Time

# Config groups under conf/, each selected in train.yaml's defaults list.
GROUPS = ("model", "data", "strategy", "optimizer", "scheduler", "algorithms", "callbacks", "loggers")


@dataclass
class TrainSettings:
    """Run-wide settings. Durations are Time strings: '400ba', '1ep', '0.5dur', '2h'."""

    run_name: str
    max_duration: str
    global_train_batch_size: int
    seed: int = 17
    # Samples per forward/backward on one device; null = the whole per-device batch.
    device_train_microbatch_size: int | None = None
    device_eval_batch_size: int | None = None
    precision: Literal["fp32", "amp_bf16", "amp_fp16"] = "fp32"
    eval_interval: str | None = None
    eval_first: bool = False
    eval_subset_num_batches: int | None = None
    # Sequence length fed to the model; null = the model's max_seq_len.
    max_seq_len: int | None = None
    # tokenizer.json used for samples and export; data_prep writes one next to the shards.
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        for key in ("max_duration", "eval_interval"):
            value = getattr(self, key)
            if value is not None:
                try:
                    Time.parse(value)
                except ValueError as err:
                    raise ValueError(f"{key}: {err}") from None
        for key in (
            "global_train_batch_size",
            "device_train_microbatch_size",
            "device_eval_batch_size",
            "eval_subset_num_batches",
            "max_seq_len",
        ):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"{key} must be a positive integer, got {value}")
