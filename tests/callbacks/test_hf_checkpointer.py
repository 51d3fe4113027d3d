"""hf_checkpointer: transformers folders written while training, as llm-foundry lays them out."""

import json
from pathlib import Path

import fsspec
import pytest
import transformers

from llmfoundry.callbacks import HFCheckpointer
from llmfoundry.distributed import unwrap_model
from llmfoundry.models import families
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


def test_llm_foundrys_default_mpt_exports_in_its_layout(tmp_path):
    """llm-foundry's default MPT (biases, learned positions), which transformers' MptForCausalLM
    cannot hold, is written in llm-foundry's layout (MPTForCausalLM, its config keys, no
    remote code) and reads back with the trained model's logits."""
    foundry_default = dict(vocab_size=320, alibi=False, no_bias=False)
    callback = HFCheckpointer(str(tmp_path / "save"), save_interval="2ba")
    trainer = make_trainer(
        tmp_path,
        n_batches=2,
        model=tiny_model(**foundry_default),
        callbacks=[callback],
        config={"tokenizer": str(TOKENIZER)},
    )
    trainer.fit()
    folder = tmp_path / "save" / "huggingface" / "ba2"
    config = json.loads((folder / "config.json").read_text())
    assert (config["architectures"], config["no_bias"], config["learned_pos_emb"]) == (
        ["MPTForCausalLM"],
        False,
        True,
    )
    assert "auto_map" not in config and (folder / "tokenizer.json").is_file()
    # (the folder as our reader takes it: transformers would have to run llm-foundry's code)
    assert families.logits_relative_error(unwrap_model(trainer.state.model), folder) <= 1e-5


def test_a_layout_that_cannot_hold_the_model_is_refused_before_training(tmp_path):
    trainer = make_trainer(
        tmp_path,
        model=tiny_model(vocab_size=320, alibi=False, learned_pos_emb=True),
        callbacks=[HFCheckpointer(str(tmp_path / "save"), layout="transformers")],
        config={"tokenizer": str(TOKENIZER)},
    )
    with pytest.raises(UserError, match=r"^hf_checkpointer: cannot export .* alibi=false"):
        trainer.fit()
    assert trainer.state.timestamp.batch == 0
