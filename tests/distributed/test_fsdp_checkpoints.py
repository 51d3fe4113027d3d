"""Sharded (FSDP, two gloo ranks on CPU) checkpoints beyond resumption: the Hugging Face export
and convert_checkpoint.py read them directly, from a local folder or from S3 (a moto server);
EMA's averages go through the shards, so they resume at another world size; background (async)
saves write the same checkpoints as synchronous ones, and a kill during one leaves none that
counts; a diverged run (NaN weights, on one rank's shard only) saves nothing and keeps its good
checkpoints, under FSDP and DDP.

Tolerance: as in test_fsdp.py (relative 1e-5 where two strategies sum in another order; state
that is only saved and loaded must come back bit for bit).
"""

import runpy
import signal
from pathlib import Path

import fsspec
import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from llmfoundry.checkpoint import checkpoint_names, clean, find_checkpoint, pretrained, read_latest
from llmfoundry.checkpoint.catalogue import MODEL_FILE, STATE_FILE, is_complete
from llmfoundry.checkpoint.sharded import IN_SHARDS, full_model_state
from llmfoundry.distributed import SingleDevice
from llmfoundry.models.mpt.config import MPTConfig
from llmfoundry.models.mpt.model import MPTForCausalLM
from tests.checkpoint.helpers import write_mds

from .checkpoint_worker import (
    EXPORT_RUN,
    GATHERED,
    HF_RUN,
    MODEL,
    TOKENIZER,
    ema_run,
    killed_rank_main,
    rank_main,
)
from .sharded_worker import DIVERGE_AT, RESUME_BATCHES, STOP_AT
from .spawn import run_ranks
from .test_fsdp import LIMIT_S, RTOL, WORLD, free_port, spawn

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
INPUT = torch.tensor([[1, 5, 9, 63, 2, 40, 7, 7]])


def script(name: str):
    """The `main` of scripts/<name>.py, called in this process."""
    return runpy.run_path(str(SCRIPTS / f"{name}.py"), run_name=name)["main"]


def hf_logits(folder: Path) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        return hf(INPUT).logits


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> tuple[Path, list[dict], dict]:
    """One-process EMA runs, then one spawn of two ranks running every case
    (checkpoint_worker.rank_main), then a one-process resumption of a two-rank checkpoint:
    the output folder, what each rank recorded, and the one-process runs' (losses, EMA)."""
    out = tmp_path_factory.mktemp("fsdp_ckpt")
    vocab = {f"w{i}": i for i in range(63)} | {"<|endoftext|>": 63}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(out / TOKENIZER))
    mds = str(write_mds(out / "mds", {"train": 32}))
    single = {
        "ema_single_straight": ema_run(SingleDevice("cpu"), mds, str(out / "ema_straight")),
        "ema_single_saved": ema_run(
            SingleDevice("cpu"), mds, str(out / "ema_single_saved"), stop_at=STOP_AT
        ),
    }
    ranks = spawn(rank_main, out, mds, n_ports=8)
    single["ema_single_from_fsdp"] = ema_run(
        SingleDevice("cpu"), mds, str(out / "ema_single_from_fsdp"), load=str(out / "ema_saved")
    )
    return out, ranks, single


@pytest.fixture(scope="module")
def out(spawned) -> Path:
    """The spawn's output folder."""
    return spawned[0]


@pytest.fixture(scope="module")
def full_export(out, tmp_path_factory) -> Path:
    """The reference: the run's final weights gathered from the live model, saved as a full
    (model.safetensors) checkpoint and exported."""
    tmp = tmp_path_factory.mktemp("full")
    fields = {k: v for k, v in MODEL.items() if k != "_target_"}
    model = MPTForCausalLM(MPTConfig(**fields, init_device="cpu"))
    model.load_state_dict(safetensors.torch.load_file(out / GATHERED), strict=True)
    full = pretrained.save_weights(model, str(tmp / "ckpt"), out / TOKENIZER)
    assert (Path(full) / MODEL_FILE).is_file()
    assert script("export_hf")([full, str(tmp / "hf")]) == 0
    return tmp / "hf"


def test_export_from_a_sharded_checkpoint_equals_the_full_export(out, full_export, tmp_path):
    save_folder = out / EXPORT_RUN
    checkpoint = save_folder / "ep1-ba3"  # three batches: the whole (list) dataloader
    assert (checkpoint / "sharded" / ".metadata").is_file()
    assert not (checkpoint / MODEL_FILE).exists()
    model, tokenizer = pretrained.load_pretrained(str(save_folder))
    assert tokenizer == str(out / TOKENIZER)  # the one its run recorded
    gathered = safetensors.torch.load_file(out / GATHERED)
    for name, value in model.state_dict().items():
        assert torch.equal(value, gathered[name]), name
    assert script("export_hf")([str(save_folder), str(tmp_path / "hf")]) == 0
    assert torch.equal(hf_logits(tmp_path / "hf"), hf_logits(full_export))


def test_hf_checkpointer_under_fsdp_writes_the_full_export(out, full_export):
    """Whole weights gathered from the two ranks' shards at the end of the run, rank 0 writes."""
    assert sorted(p.name for p in (out / HF_RUN / "huggingface").iterdir()) == ["ba3"]
    assert torch.equal(hf_logits(out / HF_RUN / "huggingface" / "ba3"), hf_logits(full_export))


def test_export_and_convert_a_sharded_checkpoint_on_s3(
    out, full_export, s3_env, monkeypatch, tmp_path
):
    # The endpoint reaches DCP's reader only through --storage (llmfoundry/utils/storage.py).
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    fs = fsspec.filesystem("s3", endpoint_url=s3_env, skip_instance_cache=True)
    fs.mkdir("sharded-bucket")
    fs.put(str(out / EXPORT_RUN), "sharded-bucket/run/checkpoints", recursive=True)
    url = "s3://sharded-bucket/run/checkpoints"
    storage = f"{{options: {{endpoint_url: '{s3_env}'}}}}"

    argv = [url, str(tmp_path / "hf"), "--tokenizer", str(out / TOKENIZER), "--storage", storage]
    assert script("export_hf")(argv) == 0
    assert torch.equal(hf_logits(tmp_path / "hf"), hf_logits(full_export))

    written = script("convert_checkpoint")(
        [url, str(tmp_path / "merged.safetensors"), "--storage", storage]
    )
    merged = safetensors.torch.load_file(written)
    gathered = safetensors.torch.load_file(out / GATHERED)
    assert merged.keys() == gathered.keys()
    for name, value in gathered.items():
        assert torch.equal(merged[name], value), name


def assert_equal(got: dict, expected: dict, **tolerance) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        if tolerance:
            torch.testing.assert_close(got[name], value, **tolerance, msg=name)
        else:
            assert torch.equal(got[name], value), name


def test_ema_of_a_two_rank_fsdp_run_resumes_on_one_rank(spawned):
    out, ranks, single = spawned
    saved = torch.load(out / "ema_saved" / f"ep0-ba{STOP_AT}" / STATE_FILE, weights_only=True)
    averages = saved["algorithms"]["EMA"]["averages"]
    assert averages and set(averages.values()) == {IN_SHARDS}  # the averages are in the shards
    at_save = ranks[0]["ema_saved"]["ema"][STOP_AT]
    recorder, ema = single["ema_single_from_fsdp"]
    assert_equal(ema.loaded, at_save)
    # It goes on as one process would have: the averages equal the one-process run's.
    straight_recorder, straight = single["ema_single_straight"]
    assert recorder.losses == pytest.approx(straight_recorder.losses[STOP_AT:], rel=RTOL)
    final = ema.after_batch[RESUME_BATCHES]
    assert_equal(final, straight.after_batch[RESUME_BATCHES], rtol=RTOL, atol=1e-6)
    # ... which the FSDP run's averages at the save equal too (no shard was lost or swapped).
    assert_equal(at_save, straight.after_batch[STOP_AT], rtol=RTOL, atol=1e-6)


def test_ema_of_a_full_checkpoint_loads_into_fsdp(spawned):
    _, ranks, single = spawned
    _, saved = single["ema_single_saved"]
    for rank in ranks:
        assert_equal(rank["ema_from_single"]["loaded"], saved.after_batch[STOP_AT])
    _, straight = single["ema_single_straight"]
    final = ranks[0]["ema_from_single"]["ema"][RESUME_BATCHES]
    assert_equal(final, straight.after_batch[RESUME_BATCHES], rtol=RTOL, atol=1e-6)


def shard_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor a sharded checkpoint's shards hold (model, optimizer, objects), whole."""
    folder = checkpoint / "sharded"
    metadata = dcp.FileSystemReader(folder).read_metadata()
    tensors = {
        key: torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }
    dcp.load(tensors, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    return tensors


def test_async_saves_write_the_checkpoints_sync_saves_write(spawned):
    out, ranks, _ = spawned
    sync, background = out / "sync_every_batch", out / "async_every_batch"
    assert read_latest(str(background)) == f"ep0-ba{RESUME_BATCHES}"
    for batch in range(1, RESUME_BATCHES + 1):
        name = f"ep0-ba{batch}"
        assert is_complete(str(background), name), name
        tensors = shard_tensors(background / name)
        assert any(k.startswith("optimizer.") for k in tensors)
        assert any(k.startswith("objects.algorithms.EMA.averages.") for k in tensors)
        assert_equal(tensors, shard_tensors(sync / name))
        states = [torch.load(f / name / STATE_FILE, weights_only=True) for f in (sync, background)]
        for state in states:
            del state["timestamp"]["wall_clock"]  # how long the run took: all that may differ
        for key in ("timestamp", "data", "algorithms"):
            assert states[0][key] == states[1][key], key
    for rank in ranks:
        assert rank["async_every_batch"]["losses"] == rank["sync_every_batch"]["losses"]
        # Resuming from a background save goes on exactly as the run that saved it.
        assert rank["sync_from_async"]["losses"] == rank["sync_every_batch"]["losses"][STOP_AT:]
        final = rank["sync_from_async"]["ema"][RESUME_BATCHES]
        assert_equal(final, rank["sync_every_batch"]["ema"][RESUME_BATCHES])


def test_a_kill_during_an_async_save_leaves_no_checkpoint_that_counts(spawned, tmp_path):
    out = spawned[0]
    exit_codes = run_ranks(
        killed_rank_main, WORLD, [free_port()], str(tmp_path), str(out / "mds"),
        limit_s=LIMIT_S, killed=True,
    )  # fmt: skip
    assert exit_codes == [-signal.SIGKILL] * WORLD
    folder = tmp_path / "async_killed"
    # Batch 2's save was being written in the background: batch 1's is the one that counts.
    assert read_latest(str(folder)) == "ep0-ba1"
    assert find_checkpoint(str(folder)) == "ep0-ba1"
    assert not is_complete(str(folder), "ep0-ba2")
    left = sorted(p.name for p in folder.iterdir() if p.name.startswith(".ep0-ba2"))
    assert ".ep0-ba2.staging" in left
    assert sorted(clean(str(folder))) == left
    assert sorted(p.name for p in folder.iterdir()) == ["ep0-ba1", "latest"]


def assert_save_refused(ranks: list[dict], name: str, folder: str) -> None:
    """Run `name` (`diverged_run`) refused its save after batch DIVERGE_AT on every rank alike,
    and its save folder holds the checkpoints before it, `latest` at the last."""
    errors = {rank[name]["error"] for rank in ranks}
    assert len(errors) == 1, errors  # one rank's NaN shard: the ranks decided together
    (error,) = errors
    assert error.startswith(
        f"CheckpointError: refusing to save checkpoint ep0-ba{DIVERGE_AT}: weight "
        "'transformer.wte.weight' holds NaN or infinity (training diverged); the earlier "
        "checkpoints are kept"
    )
    assert "\n" not in error
    # Saves every batch, keeping 2: the NaN one would have become `latest` and pruned ep0-ba1.
    assert read_latest(folder) == f"ep0-ba{DIVERGE_AT - 1}"
    assert checkpoint_names(folder) == [f"ep0-ba{b}" for b in range(1, DIVERGE_AT)]
    assert all(is_complete(folder, name) for name in checkpoint_names(folder))
    assert clean(folder) == []  # no staging or scratch folder of the refused save


@pytest.mark.parametrize("name", ["fsdp_diverged", "ddp_diverged"])
def test_a_diverged_run_saves_nothing_and_keeps_its_good_checkpoints(spawned, name):
    out, ranks, _ = spawned
    folder = out / name
    assert_save_refused(ranks, name, str(folder))
    for checkpoint in checkpoint_names(str(folder)):
        weights = (
            full_model_state(str(folder / checkpoint / "sharded"))
            if name.startswith("fsdp")
            else safetensors.torch.load_file(folder / checkpoint / MODEL_FILE)
        )
        assert all(torch.isfinite(w).all() for w in weights.values()), checkpoint
