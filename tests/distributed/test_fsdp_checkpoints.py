"""Sharded (FSDP, two gloo ranks on CPU) checkpoints beyond resumption: the Hugging Face export
and convert_checkpoint.py read them directly, from a local folder or from S3 (a moto server).
"""

import runpy
from pathlib import Path

import fsspec
import pytest
import safetensors.torch
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from llmfoundry.checkpoint.io import MODEL_FILE
from llmfoundry.models.mpt import pretrained
from llmfoundry.models.mpt.config import MPTConfig
from llmfoundry.models.mpt.model import MPTForCausalLM

from .checkpoint_worker import EXPORT_RUN, GATHERED, MODEL, TOKENIZER, rank_main
from .test_fsdp import spawn

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
def spawned(tmp_path_factory) -> tuple[Path, list[dict]]:
    """One spawn of two ranks running every case (checkpoint_worker.rank_main): its output
    folder and what each rank recorded."""
    out = tmp_path_factory.mktemp("fsdp_ckpt")
    vocab = {f"w{i}": i for i in range(63)} | {"<|endoftext|>": 63}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(out / TOKENIZER))
    return out, spawn(rank_main, out, "", n_ports=1)


@pytest.fixture(scope="module")
def out(spawned) -> Path:
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
