"""Composer checkpoints written by the real llm-foundry 0.22.0 + Composer 0.32.1
(tests/fixtures/foundry): generate, import, export and resume from them; a planted payload
never runs."""

import functools
import json
import os
import pickle
import runpy
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors.torch import load_file

from llmfoundry.checkpoint import WEIGHTS_ONLY, CheckpointError, composer, restricted_pickle
from llmfoundry.checkpoint.dcp_reader import SafeFileSystemReader
from llmfoundry.checkpoint.pretrained import read_pretrained
from llmfoundry.models import MPTForCausalLM
from llmfoundry.models.families import config_from_record
from llmfoundry.optim import DecoupledAdamW
from llmfoundry.trainer import Trainer
from llmfoundry.utils.errors import UserError

from .helpers import Batches

# dcp.save in one process, asked for.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "foundry"
ALIBI = FIXTURES / "alibi" / "ep0-ba4-rank0.pt"
SHARDED = FIXTURES / "sharded" / "ep0-ba4"  # Composer's FSDP save of the same run, 2 ranks
TOLERANCE = 1e-5


def script(name: str):
    """The `main` of scripts/<name>.py, called in this process."""
    return runpy.run_path(str(ROOT / "scripts" / f"{name}.py"), run_name=name)["main"]


def relative_error(model: torch.nn.Module, reference: Path) -> float:
    """max |ours - llm-foundry's| / max |llm-foundry's| over the fixture's reference logits."""
    ref = load_file(str(reference))
    with torch.no_grad():
        logits = model(ref["input_ids"])
    return ((logits - ref["logits"]).abs().max() / ref["logits"].abs().max()).item()


@pytest.mark.parametrize("shape", ["alibi", "learned-pos", "gqa-rope", "variants"])
def test_composer_checkpoint_computes_what_foundry_does(shape):
    loaded = read_pretrained(str(FIXTURES / shape / "ep0-ba4-rank0.pt"))
    assert relative_error(loaded.model, FIXTURES / shape / "reference-logits-ba4.safetensors") <= (
        TOLERANCE
    )
    # Its tokenizer comes from the checkpoint: the run's own files.
    tokenizer = json.loads(Path(loaded.tokenizer, "tokenizer.json").read_text())
    assert tokenizer == json.loads((FIXTURES / "tokenizer" / "tokenizer.json").read_text())


def test_generate_import_and_export(tmp_path, capsys):
    argv = [str(ALIBI), "--prompt", "the quick", "--max-new-tokens", "4", "--temperature", "0"]
    assert script("generate")(argv) == 0
    assert "--- prompt 'the quick' (length) ---" in capsys.readouterr().out
    assert script("import_hf")([str(ALIBI), str(tmp_path / "ckpt")]) == 0
    assert "logits relative error 0.00e+00" in capsys.readouterr().out
    imported = read_pretrained(str(tmp_path / "ckpt"))
    assert imported.run_name == "foundry-fixture"
    reference = FIXTURES / "alibi" / "reference-logits-ba4.safetensors"
    assert relative_error(imported.model, reference) <= TOLERANCE
    # transformers' MptForCausalLM has no biases, which llm-foundry's MPT has by default: the
    # export is llm-foundry's layout (tests/models/test_mpt_foundry_export.py), not its class.
    with pytest.raises(SystemExit, match="2"):
        script("export_hf")([str(ALIBI), str(tmp_path / "hf"), "--layout", "transformers"])
    assert "does not support: no_bias=false" in capsys.readouterr().err
    assert script("export_hf")([str(ALIBI), str(tmp_path / "hf")]) == 0
    assert "is llm-foundry's MPT layout" in capsys.readouterr().out


def test_sharded_composer_checkpoint():
    loaded = read_pretrained(str(SHARDED))
    reference = FIXTURES / "sharded" / "reference-logits-ba4.safetensors"
    assert relative_error(loaded.model, reference) <= TOLERANCE


def resumed(tmp_path: Path, path: Path = ALIBI, ignore=(), optimizer=None, **model_fields):
    """A trainer of the checkpoint's model (`model_fields` changed) continuing its run."""
    fields = {**composer.model_fields(composer.read(str(path))), **model_fields}
    config = config_from_record(fields, init_device="meta")
    optimizer = optimizer or {"_target_": "llmfoundry.optim.DecoupledAdamW"}
    return Trainer(
        model=MPTForCausalLM(config),
        optimizer=functools.partial(DecoupledAdamW, lr=1e-2, weight_decay=1e-5),
        train_dataloader=Batches([{"input_ids": torch.zeros(4, 32, dtype=torch.long)}] * 16),
        max_duration="8ba",
        run_dir=tmp_path,
        load_path=str(path),
        load_ignore_keys=ignore,
        config={"model": fields, "optimizer": optimizer},
    )


@pytest.mark.parametrize("path", [ALIBI, SHARDED], ids=["monolithic", "sharded"])
def test_resume_takes_optimizer_position_and_rng(tmp_path, path):
    theirs = composer.read(str(path))
    trainer = resumed(tmp_path, path)
    ts = trainer.state.timestamp
    assert (ts.epoch, ts.batch, ts.sample, ts.token, ts.sample_in_epoch) == (0, 4, 16, 512, 16)
    assert trainer.state.train_dataloader.skip == 4  # batches of 4 samples: 16 samples in
    moments = theirs.state["optimizers"]["DecoupledAdamW"]["state"]
    for name, param in trainer.state.model.named_parameters():
        ours, saved = trainer.state.optimizer.state[param], moments[f"model.{name}"]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ours[key], saved[key]), (name, key)
        assert ours["step"].item() == saved["step"].item() == 4
    assert torch.equal(trainer._resume_rng["torch"], theirs.rng[0]["torch"])


def test_weights_only_composer_checkpoint_finetunes(tmp_path):
    path = FIXTURES / "learned-pos" / "ep0-ba4-rank0.pt"  # Composer's save_weights_only layout
    with pytest.raises(UserError, match=r"has no optimizer, timestamp, data .* weights only"):
        resumed(tmp_path, path)
    trainer = resumed(tmp_path, path, ignore=WEIGHTS_ONLY)
    theirs = composer.weights(composer.read(str(path)))
    for name, tensor in trainer.state.model.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name
    assert trainer.state.timestamp.batch == 0


def test_another_optimizer_is_refused_unless_ignored(tmp_path):
    lion = {"_target_": "llmfoundry.optim.DecoupledLionW"}
    with pytest.raises(CheckpointError, match=r"optimizer\._target_: 'llmfoundry.optim.Decoupled"):
        resumed(tmp_path, optimizer=lion)
    assert resumed(tmp_path, optimizer=lion, ignore=["optimizer"]).state.timestamp.batch == 4


def test_a_run_state_of_another_layout_is_one_line(tmp_path):
    saved = restricted_pickle.load(ALIBI)
    saved["rng"] = [{"python": "not a state"}]  # what a damaged or other writer's file may hold
    path = tmp_path / "ep0-ba4-rank0.pt"
    torch.save(saved, path)
    with pytest.raises(CheckpointError, match=r"not laid out as Composer 0\.32 writes it.*rng\]"):
        composer.read_run(str(path), rank=0)


def test_resume_into_another_model_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"cannot continue .* model\.n_layers: 2 -> 3"):
        resumed(tmp_path, n_layers=3)


def _train_losses(command: list[str], cwd: Path, run_name: str) -> tuple[dict[int, float], str]:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = (cwd / "outputs" / run_name / "metrics.jsonl").read_text().splitlines()
    losses = {}
    for line in map(json.loads, lines):
        if "loss/train" in line.get("metrics", {}):
            losses[line["step"]] = line["metrics"]["loss/train"]
    return losses, done.stderr


def _their_losses() -> dict[int, float]:
    record = json.loads((FIXTURES / "alibi" / "resume-losses.json").read_text())
    return {int(batch): loss for batch, loss in record["losses"].items()}


@pytest.mark.slow
def test_train_script_continues_foundry_run_from_their_yaml(tmp_path):
    """`scripts/train.py their.yaml load_path=<their ba4 checkpoint>` continues the run
    llm-foundry started: batches 5..8 have llm-foundry's own losses, since weights, optimizer
    state, data position and (scheduler.composer_lag, which the translation sets) the lr curve
    carried over."""
    cfg = yaml.safe_load((FIXTURES / "alibi" / "train.yaml").read_text())
    cfg["variables"]["data_local"] = str(FIXTURES / "mds")
    cfg["tokenizer"]["name"] = str(FIXTURES / "tokenizer")
    del cfg["loggers"], cfg["callbacks"]  # their in-memory logger; exports are not compared
    cfg.update(save_folder=str(tmp_path / "ckpt"), load_path=str(ALIBI), run_name="resumed")
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(cfg))
    command = [sys.executable, str(ROOT / "scripts" / "train.py"), "train.yaml"]
    losses, stderr = _train_losses(command, tmp_path, "resumed")
    theirs = _their_losses()
    assert "steps one batch ahead of Composer's" not in stderr  # composer_lag is on
    assert sorted(losses) == [5, 6, 7, 8]
    for batch in losses:
        assert losses[batch] == pytest.approx(theirs[batch], rel=TOLERANCE), batch


@pytest.mark.slow
def test_train_script_continues_foundry_run(tmp_path):
    """A native config continuing their run: batch 5 (the first after the checkpoint) has
    llm-foundry's loss, since weights and data position carried over; the lr curve follows
    theirs only with scheduler.composer_lag=true (which the test above runs: their YAML's
    translation sets it), and without it the log says so."""
    command = [
        sys.executable,
        str(ROOT / "scripts" / "train.py"),
        "model=from_checkpoint",
        f"load_path={ALIBI}",
        f"data.remote={FIXTURES / 'mds'}",
        "data.shuffle=false",
        "data.eval_split=null",
        f"tokenizer={FIXTURES / 'tokenizer'}",
        "max_seq_len=32",
        "global_train_batch_size=4",
        "device_train_microbatch_size=2",
        "optimizer.lr=1e-2",
        "optimizer.weight_decay=1e-5",
        "scheduler.t_warmup=2ba",
        "scheduler.alpha_f=0.1",
        "scheduler.composer_lag=false",
        "max_duration=8ba",
        "precision=fp32",
        "seed=17",
        f"save_folder={tmp_path / 'ckpt'}",
        "callbacks=[]",
        "loggers=[jsonl]",
        "eval_first=false",
        "run_name=resumed",
    ]
    losses, stderr = _train_losses(command, tmp_path, "resumed")
    theirs = _their_losses()
    assert "not carried over: its algorithms' state (GradientClipping" in stderr
    assert "steps one batch ahead of Composer's; set scheduler.composer_lag=true" in stderr
    assert sorted(losses) == [5, 6, 7, 8]
    assert losses[5] == pytest.approx(theirs[5], rel=TOLERANCE)
    later_equal = [losses[b] == pytest.approx(theirs[b], rel=TOLERANCE) for b in (6, 7, 8)]
    assert later_equal == [False] * 3


class _Payload:
    def __init__(self, call, marker):
        self.call, self.marker = call, marker

    def __reduce__(self):
        if self.call == "exec":
            return (exec, (f"open({str(self.marker)!r}, 'w').close()",))
        if self.call == "popen":
            return (subprocess.Popen, (["touch", str(self.marker)],))
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize(
    ("call", "name"),
    [
        ("system", f"{os.system.__module__}.system"),
        ("exec", "builtins.exec"),
        ("popen", "subprocess.Popen"),
    ],
)
def test_planted_payload_never_runs(tmp_path, call, name, capsys):
    marker = tmp_path / "ran"
    planted = tmp_path / "ep0-ba4-rank0.pt"
    saved = restricted_pickle.load(ALIBI)
    saved["state"]["integrations"]["evil"] = _Payload(call, marker)
    torch.save(saved, planted)
    with pytest.raises(CheckpointError, match=f"refusing to load .*: it needs {name}, which"):
        read_pretrained(str(planted))
    # As a user sees it: one line naming the class, and nothing ran.
    with pytest.raises(SystemExit, match="2"):
        script("generate")([str(planted), "--prompt", "x"])
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"it needs {name}," in error
    assert not marker.exists()


def test_payload_in_a_sharded_checkpoint_never_runs(tmp_path):
    marker = tmp_path / "ran"
    folder = tmp_path / "ep0-ba4"
    state = {"model": {"model.w": torch.ones(2)}, "evil": _Payload("system", marker)}
    dcp.save({"state": state}, checkpoint_id=str(folder), no_dist=True)
    with pytest.raises(CheckpointError, match=f"it needs {os.system.__module__}.system"):
        composer.read(str(folder))
    assert not marker.exists()


def test_compressed_or_oversized_pickle_is_refused(tmp_path, monkeypatch):
    deflated = tmp_path / "deflated.pt"
    with zipfile.ZipFile(ALIBI) as src, zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as dst:
        for entry in src.infolist():
            dst.writestr(entry.filename, src.read(entry))
    with pytest.raises(CheckpointError, match="is compressed"):
        read_pretrained(str(deflated))
    monkeypatch.setattr(restricted_pickle, "MAX_PICKLE_BYTES", 1000)
    with pytest.raises(CheckpointError, match="its pickle is .* bytes, more than"):
        read_pretrained(str(ALIBI))


def test_sharded_metadata_declaring_more_than_its_files_hold_is_refused(tmp_path):
    """A .metadata of a few bytes could otherwise make the reader allocate any size."""
    folder = tmp_path / "ep0-ba4"
    shutil.copytree(SHARDED, folder)
    metadata = SafeFileSystemReader(str(folder)).read_metadata()
    item = metadata.state_dict_metadata["state.model.model.transformer.wte.weight"]
    item.size = torch.Size([2**20, 2**20])  # 4 TiB of float32
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="declares .* bytes of tensors but its shard files"):
        read_pretrained(str(folder))
