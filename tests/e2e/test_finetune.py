"""Instruction finetuning: response-only loss, packing isolation, the `+experiment=finetune` recipe."""

import dataclasses
import json
import math
import runpy
import shlex
from pathlib import Path

import pytest
import torch

from llmfoundry.build import build_trainer
from llmfoundry.checkpoint.pretrained import load_pretrained, save_weights
from llmfoundry.config import ConfigError
from llmfoundry.config.preflight import check, compose_config
from llmfoundry.data.prep import train_bpe
from llmfoundry.data.prep.instructions import IGNORE, Packer, instructions_to_mds
from llmfoundry.data.streaming import StreamingDataLoader
from llmfoundry.data.text import StreamingTextDataset
from llmfoundry.models.families import family_of
from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM
from llmfoundry.tokenizers.tokenizer import prepare_tokenizer
from tests.models.foundry_folder import random_model, write_foundry_folder

CONF = Path(__file__).resolve().parents[2] / "conf"
VOCAB, SEQ = 300, 64


def tiny(seed: int = 0) -> MPTForCausalLM:
    torch.manual_seed(seed)
    config = MPTConfig(d_model=32, n_heads=2, n_layers=2, max_seq_len=SEQ, vocab_size=VOCAB)
    return MPTForCausalLM(config).eval()


def test_loss_equals_a_hand_computation():
    logits = torch.randn(1, 4, 7)
    labels = torch.tensor([[IGNORE, IGNORE, 5, 2]])  # a prompt of two tokens, a response of two
    # Position t predicts labels[t + 1]: positions 1 and 2 count, 0 (-> a prompt token) does not.
    by_hand = []
    for t, target in ((1, 5), (2, 2)):
        row = logits[0, t].tolist()
        by_hand.append(math.log(sum(math.exp(v) for v in row)) - row[target])
    loss = MPTForCausalLM.loss(logits, labels)
    assert math.isclose(loss.item(), sum(by_hand) / 2, rel_tol=1e-6)


def test_prompt_tokens_contribute_nothing():
    """Whatever the model predicts at prompt positions, the loss and its gradient do not move."""
    model = tiny()
    packer = Packer(SEQ, pad_id=0)
    ids = torch.randint(1, VOCAB, (20,))
    labels = ids.clone()
    labels[:12] = IGNORE  # 12 prompt tokens, 8 response tokens
    packer.add(ids.numpy(), labels.numpy())
    (row,) = packer.flush()
    batch = {k: torch.from_numpy(v)[None] for k, v in row.items()}
    logits = model(batch["tokens"], batch["sequence_id"]).detach().requires_grad_()
    loss = MPTForCausalLM.loss(logits, batch["labels"])
    loss.backward()
    predicts_prompt_or_pad = torch.ones(SEQ, dtype=torch.bool)
    predicts_prompt_or_pad[:-1] = batch["labels"][0, 1:] == IGNORE
    assert predicts_prompt_or_pad.sum() == SEQ - 8
    assert logits.grad[0, predicts_prompt_or_pad].abs().max() == 0
    assert logits.grad[0, ~predicts_prompt_or_pad].abs().max() > 0
    changed = logits.detach().clone()
    changed[0, predicts_prompt_or_pad] = torch.randn_like(changed[0, predicts_prompt_or_pad]) * 9
    assert torch.equal(MPTForCausalLM.loss(changed, batch["labels"]), loss.detach())


def test_packed_examples_do_not_attend_to_each_other():
    model = tiny()
    examples = [torch.randint(1, VOCAB, (n,)) for n in (23, 17, 9)]
    packer = Packer(SEQ, pad_id=0)
    for ids in examples:
        packer.add(ids.numpy(), ids.numpy())
    (row,) = packer.flush()
    tokens, seq = torch.from_numpy(row["tokens"])[None], torch.from_numpy(row["sequence_id"])[None]
    with torch.no_grad():
        packed = model(tokens, seq)[0]
        for n, ids in enumerate(examples):
            alone = model(ids[None])[0]
            torch.testing.assert_close(packed[seq[0] == n], alone, rtol=1e-4, atol=1e-5)


def _instruction_data(root: Path) -> tuple[Path, str]:
    texts = [f"def f{i}(x):\n    return x * {i}\n" for i in range(50)] + ["Return x."] * 20
    tokenizer = root / "tokenizer.json"
    tokenizer.write_text(train_bpe(texts, vocab_size=VOCAB).to_str())
    rows = [{"prompt": f"def f{i}(x):", "response": f"Return x times {i}."} for i in range(60)]
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    instructions_to_mds(
        [str(root / "sft.jsonl")], str(root / "sft"), str(tokenizer), SEQ, val_fraction=0.2
    )
    return root / "sft", str(tokenizer)


def test_finetune_recipe_starts_from_pretrained_weights(tmp_path, caplog):
    data, tokenizer = _instruction_data(tmp_path)
    pretrained = tiny(seed=3)
    save_weights(pretrained, str(tmp_path / "base"), tokenizer)
    overrides = [
        "+experiment=finetune",
        f"load_path={tmp_path / 'base'}",
        f"data.remote={data}",
        f"tokenizer={tokenizer}",
        "model.d_model=32", "model.n_heads=2", "model.n_layers=2",
        f"model.max_seq_len={SEQ}", f"model.vocab_size={VOCAB}",
        "global_train_batch_size=4", "device_eval_batch_size=4", "max_duration=2ep",
        "callbacks=[]", "loggers=[]", "save_folder=null", "eval_first=true",
    ]  # fmt: skip
    cfg = compose_config(CONF, overrides)
    assert cfg.scheduler._target_.endswith("LinearWithWarmup")
    assert "optimizer" in cfg.load_ignore_keys and "model" not in cfg.load_ignore_keys
    trainer = build_trainer(cfg, tmp_path / "run")
    assert "changed recipe" not in caplog.text  # a new run from the weights, not a resumption
    # Before any step, the model is the pretrained one: its response-only val loss by hand.
    loader = StreamingDataLoader(StreamingTextDataset(str(data), split="val", batch_size=4))
    loader.set_epoch(0)
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in loader:
            logits = pretrained(batch["input_ids"], batch["sequence_id"])
            n = int((batch["labels"][:, 1:] != IGNORE).sum())
            total += MPTForCausalLM.loss(logits, batch["labels"]).item() * n
            count += n
    assert trainer.state.timestamp.batch == 0  # weights only: the pretraining position is not
    start = trainer.evaluate()["eval/val/loss"]
    assert math.isclose(start, total / count, rel_tol=1e-5)
    metrics = trainer.fit().eval_metrics
    assert metrics["eval/val/loss"] < start
    tuned, _ = load_pretrained(str(tmp_path / "base"))  # the base checkpoint is left untouched
    assert all(
        torch.equal(a, b)
        for a, b in zip(tuned.state_dict().values(), pretrained.state_dict().values(), strict=True)
    )


def test_finetune_recipe_without_load_path_is_a_config_error():
    with pytest.raises(ConfigError, match="load_ignore_keys: set, but load_path is null"):
        check(CONF, ["+experiment=finetune"])


@pytest.mark.parametrize("layout", ["transformers", "llm-foundry"])
def test_import_hf_prints_a_finetune_command_that_trains_as_printed(
    layout, tmp_path, monkeypatch, capsys
):
    """scripts/import_hf.py's printed command, run as printed (plus the test's sizes) from a
    folder with the recipe's data: weights only, the model config from the checkpoint. From
    transformers' MptForCausalLM folder, and from llm-foundry's (learned positions, biases)."""
    (tmp_path / "data" / "demo").mkdir(parents=True)
    _instruction_data(tmp_path / "data" / "demo")  # the recipe's data.remote: data/demo/sft
    tokenizer = prepare_tokenizer(tmp_path / "data" / "demo" / "tokenizer.json")
    if layout == "transformers":
        imported = tiny(seed=5)
        family_of(imported).export_to_hf(
            imported, tmp_path / "hf", tokenizer=tokenizer.tokenizer, eos_token=tokenizer.eos_token
        )
    else:
        imported = random_model(
            seed=5, alibi=False, no_bias=False, max_seq_len=SEQ, vocab_size=VOCAB
        )
        write_foundry_folder(
            imported, tmp_path / "hf", tokenizer=tokenizer.tokenizer, eos_token=tokenizer.eos_token
        )
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "eos_token_id": 2}))
    main = runpy.run_path(str(CONF.parent / "scripts" / "import_hf.py"), run_name="x")["main"]
    assert main([str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    out, err = capsys.readouterr()
    assert f"eos_token_id 2 is not the tokenizer's EOS id {tokenizer.eos_id}" in err
    assert sum("eos_token_id" in line for line in err.splitlines()) == 1  # one line
    command = shlex.split(out.split("finetune it with: ")[1].splitlines()[0])
    assert command[:2] == ["python", "scripts/train.py"]
    sizes = ["global_train_batch_size=4", "device_eval_batch_size=4", "max_duration=2ba"]
    sizes += ["eval_subset_num_batches=1", "callbacks=[]", "loggers=[]", "save_folder=null"]
    monkeypatch.chdir(tmp_path)
    trainer = build_trainer(compose_config(CONF, command[2:] + sizes), tmp_path / "run")
    built = trainer.state.model.config  # built on meta, whatever the recorded init_device
    assert dataclasses.replace(built, init_device="cpu") == imported.config
    loaded = trainer.state.model.state_dict().values()
    for a, b in zip(loaded, imported.state_dict().values(), strict=True):
        assert torch.equal(a, b)  # the imported weights, loaded alone
    trainer.fit()
    assert trainer.state.timestamp.batch == 2


def test_model_from_checkpoint_without_load_path_is_a_config_error():
    with pytest.raises(ConfigError, match="model=from_checkpoint .* load_path is not set"):
        check(CONF, ["model=from_checkpoint"])
