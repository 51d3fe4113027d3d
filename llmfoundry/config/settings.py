"""The top-level keys of `conf/train.yaml`; config groups are validated by their `_target_`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from llmfoundry.checkpoint import check_ignore_keys
from llmfoundry.core.time import Time, TimeUnit
from llmfoundry.utils.errors import UserError
from llmfoundry.utils.storage import parse_settings

# Config groups under conf/, each selected in train.yaml's defaults list.
GROUPS = (
    "model",
    "data",
    "strategy",
    "optimizer",
    "scheduler",
    "converters",
    "algorithms",
    "callbacks",
    "loggers",
)


@dataclass
class TrainSettings:
    """Run-wide settings. Durations are Time strings: '400ba', '1ep', '0.5dur', '2h'."""

    run_name: str
    max_duration: str
    global_train_batch_size: int
    seed: int = 17
    # Samples per forward/backward on one device; null = the whole per-device batch; 'auto' =
    # start from the whole per-device batch and halve on out-of-memory errors (under fsdp only
    # until a size has fit 2 steps: an out-of-memory error after that ends the run, and a
    # resumed run searches again).
    device_train_microbatch_size: int | Literal["auto"] | None = None
    device_eval_batch_size: int | None = None
    # Samples per eval forward (evaluation holds one forward's logits); null =
    # device_train_microbatch_size when it is a number, else the per-device train batch.
    device_eval_microbatch_size: int | None = None
    # auto: amp_bf16 on a GPU with bf16 tensor cores (compute capability 8.0+), else fp32.
    # amp_fp8: amp_bf16 with the blocks' matmuls in float8 (converters=[float8]; a GPU of
    # compute capability 8.9+).
    precision: Literal["auto", "fp32", "amp_bf16", "amp_fp16", "amp_fp8"] = "auto"
    eval_interval: str | None = None
    eval_first: bool = False
    eval_subset_num_batches: int | None = None
    # Sequence length fed to the model; null = the model's max_seq_len.
    max_seq_len: int | None = None
    # tokenizer.json used for samples and export; data_prep writes one next to the shards.
    tokenizer: str | None = None

    # Checkpoints (llmfoundry/checkpoint). save_folder: a local folder or fsspec URL
    # (s3://bucket/run/checkpoints); null saves none. save_interval: a Time string; null saves
    # only when the run stops or ends. num_checkpoints_to_keep: -1 keeps all.
    save_folder: str | None = None
    save_interval: str | None = None
    num_checkpoints_to_keep: int = -1
    # A checkpoint folder (or a save folder: its latest) to start from, and the parts of it not
    # to load, e.g. [optimizer, scaler, timestamp, algorithms, callbacks, loggers, data, rng]
    # to finetune from weights.
    load_path: str | None = None
    load_ignore_keys: list[str] = field(default_factory=list)
    # Continue from <save_folder>/latest when it exists: rerun the same command after a crash.
    autoresume: bool = False
    # Object-store settings for every remote read and write (llmfoundry/utils/storage.py):
    # {options: {endpoint_url: ..., profile: ...}, overrides: {"s3://bucket/": {...}}}.
    storage: dict[str, Any] | None = None
    # A save_folder that already holds checkpoints is refused unless the run continues from
    # them (autoresume); true replaces them instead.
    save_overwrite: bool = False

    def __post_init__(self) -> None:
        parse_settings(self.storage)
        for key in ("max_duration", "eval_interval", "save_interval"):
            value = getattr(self, key)
            if value is not None:
                try:
                    time = Time.parse(value)
                except ValueError as err:
                    raise UserError(f"{key}: {err}") from None
                _check_duration(key, time)
        for key in (
            "global_train_batch_size",
            "device_train_microbatch_size",
            "device_eval_batch_size",
            "device_eval_microbatch_size",
            "eval_subset_num_batches",
            "max_seq_len",
        ):
            value = getattr(self, key)
            if key == "device_train_microbatch_size" and value == "auto":
                continue
            if value is not None and value < 1:
                raise UserError(f"{key} must be a positive integer, got {value}")
        if self.num_checkpoints_to_keep == 0 or self.num_checkpoints_to_keep < -1:
            raise UserError(
                f"num_checkpoints_to_keep: must be -1 (keep all) or positive, got "
                f"{self.num_checkpoints_to_keep}"
            )
        check_ignore_keys(self.load_ignore_keys)
        if self.load_ignore_keys and not self.load_path and not self.autoresume:
            raise UserError(
                "load_ignore_keys: set, but load_path is null, so nothing is loaded; give "
                "load_path=<checkpoint or save folder> (e.g. the pretraining run's to finetune)"
            )
        if self.autoresume and not self.save_folder:
            raise UserError(
                "autoresume: it continues from <save_folder>/latest, but save_folder is null; "
                "set save_folder"
            )


def _check_duration(key: str, time: Time) -> None:
    """Durations the loop cannot act on: a run length relative to itself, an empty interval."""
    if key == "max_duration" and time.unit is TimeUnit.DURATION:
        raise UserError(
            f"max_duration: {time}: 'dur' is a fraction of max_duration itself; give the run's length "
            "in ep, ba, sp, tok or wall-clock time (e.g. 1000ba, 1ep, 2h)"
        )
    if time.value == 0:
        what = "the run would not train" if key == "max_duration" else f"{key}=null turns it off"
        raise UserError(f"{key}: {time} is empty; give a positive amount ({what})")
