"""hf_checkpointer: transformers folders written while training, as llm-foundry lays them out."""

import json
from pathlib import Path

import fsspec
import pytest
import transformers

from llmfoundry.callbacks import HFCheckpointer
from llmfoundry.distributed import unwrap_model
from llmfoundry.models.hf_folder import logits_relative_error
from llmfoundry.utils.errors import UserError
from tests.callbacks.conftest import make_trainer
from tests.trainer.conftest import tiny_model

TOKENIZER = Path(__file__).resolve().parents[1] / "fixtures" / "foundry" / "tokenizer"


def trainer_with(tmp_path, *callbacks, n_batches=4):
    return make_trainer(
        tmp_path,
        n_batches=n_batches,
        model=tiny_model(vocab_size=320),
        callbacks=list(callbacks),
        config={"tokenizer": str(TOKENIZER)},
    )


def test_folders_at_each_interval_and_the_end_load_in_transformers_with_our_logits(tmp_path):
    local = HFCheckpointer(str(tmp_path / "save"), save_interval="3ba")
    bucket = f"/{tmp_path.name}/run"  # (memory:// is one store for the whole process)
    remote = HFCheckpointer(f"memory://{bucket}", precision="bfloat16")  # the end only
    trainer = trainer_with(tmp_path, local, remote)
    trainer.fit()
    exports = tmp_path / "save" / "huggingface"
    assert sorted(p.name for p in exports.iterdir()) == ["ba3", "ba4"]
    model = unwrap_model(trainer.state.model)
    assert logits_relative_error(model, exports / "ba4") <= 1e-5
    assert logits_relative_error(model, exports / "ba3") > 1e-3  # an earlier point of the run
    tokenizer = transformers.AutoTokenizer.from_pretrained(exports / "ba4")
    assert len(tokenizer) == 320
    fs = fsspec.filesystem("memory")
    assert fs.ls(f"{bucket}/huggingface", detail=False) == [f"{bucket}/huggingface/ba4"]
    assert fs.exists(f"{bucket}/huggingface/ba4/model.safetensors")
    assert fs.exists(f"{bucket}/huggingface/ba4/tokenizer.json")
    config = json.loads(fs.cat(f"{bucket}/huggingface/ba4/config.json"))
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"


def test_an_existing_folder_is_replaced_only_under_overwrite(tmp_path):
    (tmp_path / "save" / "huggingface" / "ba1").mkdir(parents=True)
    kept = HFCheckpointer(str(tmp_path / "save"), overwrite=False)
    with pytest.raises(UserError, match=r"huggingface/ba1 exists already; set overwrite: true"):
        trainer_with(tmp_path, kept, n_batches=1).fit()
    trainer_with(tmp_path / "again", HFCheckpointer(str(tmp_path / "save")), n_batches=1).fit()
    assert (tmp_path / "save" / "huggingface" / "ba1" / "model.safetensors").is_file()


def test_a_model_transformers_cannot_hold_is_refused_before_training(tmp_path):
    trainer = make_trainer(
        tmp_path,
        model=tiny_model(vocab_size=320, alibi=False, learned_pos_emb=True),
        callbacks=[HFCheckpointer(str(tmp_path / "save"))],
        config={"tokenizer": str(TOKENIZER)},
    )
    with pytest.raises(UserError, match=r"^hf_checkpointer: cannot export .* alibi=false"):
        trainer.fit()
    assert trainer.state.timestamp.batch == 0
