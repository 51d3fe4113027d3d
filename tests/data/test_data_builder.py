"""The data config group through its one builder (data/builder.py), as build_trainer uses it."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from llmfoundry.config import ConfigError
from llmfoundry.config.preflight import check
from llmfoundry.data import DataSplits, MemmapTokens, StreamingTextDataset, build_loaders
from llmfoundry.data.builder import group_hints
from llmfoundry.data.streaming import StreamingDataLoader
from llmfoundry.utils.errors import UserError
from tests.data.test_streaming_text import token_rows, write_tokens

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    write_tokens(tmp_path / "mds" / "train", token_rows(100))
    write_tokens(tmp_path / "mds" / "val", token_rows(10, start=500))
    return tmp_path / "mds"


def group(name: str = "mds", **overrides):
    """conf/data/<name>.yaml with overrides, as Hydra composes it."""
    node = OmegaConf.load(CONF / "data" / f"{name}.yaml")
    return OmegaConf.merge(node, OmegaConf.create(overrides))


def loaders(batch_size=8, eval_batch_size=4, max_seq_len=None, data_parallel=None, **overrides):
    return build_loaders(
        group(**overrides),
        batch_size=batch_size,
        eval_batch_size=eval_batch_size,
        max_seq_len=max_seq_len,
        data_parallel=data_parallel,
    )


def test_drop_last_drops_training_batches_only(root: Path):
    """10 val rows in batches of 4: evaluation still reads every one (drop_last=true used to
    drop its last 2, and all of a split smaller than one batch)."""
    data = loaders(eval_batch_size=4, remote=str(root), drop_last=True)
    assert len(data.train) == 12  # 100 rows: the short 13th batch is dropped
    data.evals["val"].set_epoch(0)
    assert sum(len(b["input_ids"]) for b in data.evals["val"]) == 10


def test_train_and_eval_loaders(root: Path):
    data = loaders(max_seq_len=16, remote=str(root))
    train = data.train
    assert isinstance(data.train_dataset, StreamingTextDataset) and list(data.evals) == ["val"]
    assert len(train) == 13
    train.set_epoch(0)
    batches = list(train)
    assert len(batches) == 13 and batches[0]["input_ids"].shape == (8, 16)
    assert batches[-1]["input_ids"].shape == (4, 16) and "sample_mask" not in batches[0]
    seen = torch.cat([b["input_ids"][:, 0] for b in batches]).tolist()
    first_tokens = token_rows(100)[:, 0].tolist()
    assert sorted(seen) == sorted(first_tokens) and seen != first_tokens  # all, shuffled
    train.set_epoch(1)
    assert torch.cat([b["input_ids"][:, 0] for b in train]).tolist() != seen
    rows = torch.cat([b["input_ids"] for b in data.evals["val"]])
    assert torch.equal(rows, torch.from_numpy(token_rows(10, start=500))[:, :16])  # in order


def test_trainer_resumption_contract(root: Path):
    loader = loaders(remote=str(root)).train
    loader.set_epoch(5)
    full = [b["input_ids"] for b in loader]
    state = loader.state_dict(num_samples=3 * 8)  # three steps of a global batch of 8
    assert json.loads(json.dumps(state)) == state  # plain data, fits any checkpoint
    fresh = loaders(remote=str(root)).train
    fresh.load_state_dict(state)
    fresh.set_epoch(5)
    rest = [b["input_ids"] for b in fresh]
    assert len(rest) == len(full) - 3 and all(
        torch.equal(a, b) for a, b in zip(rest, full[3:], strict=True)
    )
    fresh.set_epoch(6)
    assert len(list(fresh)) == len(full)


def test_streams_shape_training_only(tmp_path: Path):
    write_tokens(tmp_path / "a" / "train", token_rows(40))
    write_tokens(tmp_path / "a" / "val", token_rows(4, start=900))
    write_tokens(tmp_path / "b" / "train", token_rows(10, start=1000))
    write_tokens(tmp_path / "b" / "val", token_rows(4, start=950))
    data = loaders(
        batch_size=10,
        eval_batch_size=10,
        remote=None,
        epoch_size=60,
        streams={"a": {"remote": str(tmp_path / "a"), "proportion": 0.5},
                 "b": {"remote": str(tmp_path / "b"), "proportion": 0.5}},
    )  # fmt: skip
    firsts = torch.cat([b["input_ids"][:, 0] for b in data.train])
    from_b = set(token_rows(10, start=1000)[:, 0].tolist())
    assert len(firsts) == 60 and sum(int(t) in from_b for t in firsts) == 30  # b up-sampled 3x
    assert sum(len(b["input_ids"]) for b in data.evals["val"]) == 8  # each stream's split once


def test_eval_datasets_by_remote_arguments_or_node(root: Path, tmp_path: Path):
    write_tokens(tmp_path / "code" / "val", token_rows(6, start=2000))
    write_tokens(tmp_path / "code" / "train", token_rows(6, start=3000))
    node = {"_target_": "llmfoundry.data.StreamingTextDataset", "_partial_": True}
    data = loaders(
        remote=str(root),
        eval_datasets={
            "code": str(tmp_path / "code"),  # a remote: everything else as the main data
            "eos": {"sequence_id_from_eos": 0},  # arguments changed, the main remote
            "plain": node,  # a node of its own without a remote reads the group's
        },
    )
    assert list(data.evals) == ["val", "code", "eos", "plain"]
    code = torch.cat([b["input_ids"] for b in data.evals["code"]])
    assert torch.equal(code, torch.from_numpy(token_rows(6, start=2000)))
    main = torch.cat([b["input_ids"] for b in data.evals["val"]])
    for label in ("eos", "plain"):
        assert torch.equal(torch.cat([b["input_ids"] for b in data.evals[label]]), main)
    assert "sequence_id" in next(iter(data.evals["eos"]))
    assert "sequence_id" not in next(iter(data.evals["plain"]))
    with pytest.raises(UserError, match="label 'val' is taken"):
        loaders(remote=str(root), eval_datasets={"val": str(root)})


def test_bad_values_are_one_line_user_errors(root: Path):
    with pytest.raises(UserError, match="data.remote=null"):
        loaders(streams={"a": {"remote": str(root)}})
    with pytest.raises(UserError, match=r"streams.a: unknown key\(s\) \['split'\]"):
        loaders(remote=None, streams={"a": {"remote": str(root), "split": "x"}})
    with pytest.raises(UserError, match="remote is required"):
        loaders(remote=None)
    with pytest.raises(UserError, match="prefetch_factor needs num_workers > 0"):
        loaders(remote=str(root), prefetch_factor=2)
    with pytest.raises(UserError, match="validate_hash='sha'"):
        loaders(remote=str(root), validate_hash="sha")
    with pytest.raises(ValueError, match="cache_limit"):
        loaders(remote=str(root), cache_limit="lots")
    with pytest.raises(UserError, match="num_workers must be an integer >= 0"):
        loaders(remote=str(root), num_workers=-1)
    with pytest.raises(UserError, match="sequence_id_from_eos must be null, a token id or 'auto'"):
        loaders(remote=str(root), sequence_id_from_eos="yes")
    with pytest.raises(FileNotFoundError, match="data_prep"):
        loaders(remote=str(root / "nope"))
    with pytest.raises(FileNotFoundError, match=r"available splits .*\['train', 'val'\]"):
        loaders(remote=str(root), eval_split="test")
    with pytest.raises(UserError, match="_partial_: true"):
        loaders(remote=str(root), _partial_=False)


def test_dataloader_workers_match_the_main_process(root: Path):
    a = [b["input_ids"] for b in loaders(batch_size=6, remote=str(root)).train]
    two = loaders(batch_size=6, remote=str(root), num_workers=2, prefetch_factor=2).train
    b = [b["input_ids"] for b in two]
    assert len(a) == len(b) == 17 and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_pin_memory_defaults_to_whether_cuda_is_there(root: Path, monkeypatch):
    dataset = StreamingTextDataset(str(root), split="val", batch_size=2)
    for cuda in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        assert StreamingDataLoader(dataset).pin_memory is cuda
    assert loaders(remote=str(root), pin_memory=False).train.pin_memory is False


@pytest.mark.parametrize(
    ("name", "dataset", "chosen"),
    [("mds", StreamingTextDataset, {"remote", "shuffle"}), ("memmap", MemmapTokens, {"remote"})],
)
def test_config_values_are_the_signatures_defaults(name, dataset, chosen):
    """One definition of each setting's default: the signature that takes it. The yaml lists
    every key (so `data.key=value` overrides work) with that default, apart from the recipe's
    own choices."""
    node = OmegaConf.to_container(group(name))
    assert node["_target_"] == f"llmfoundry.data.{dataset.__name__}" and node["_partial_"]
    defaults = {
        name: p.default
        for cls in [*dataset.__mro__, StreamingDataLoader]
        if "__init__" in vars(cls)
        for name, p in inspect.signature(cls.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    defaults |= vars(DataSplits())
    keys = [k for k in node if not k.startswith("_")]
    assert set(keys) <= set(defaults) and set(keys) >= set(group_hints())
    assert {k: node[k] for k in keys if k not in chosen} == {
        k: defaults[k] for k in keys if k not in chosen
    }


def test_misspelt_data_keys_get_suggestions():
    """The schema follows StreamingTextDataset's **kwargs to StreamingDataset's arguments."""
    with pytest.raises(
        ConfigError, match="data.shuffle_sed: unknown key; did you mean 'shuffle_seed'"
    ):
        check(CONF, ["+data.shuffle_sed=3"])
    with pytest.raises(
        ConfigError, match="data.num_worker: unknown key; did you mean 'num_workers'"
    ):
        check(CONF, ["+data.num_worker=3"])
    with pytest.raises(ConfigError, match="data.shuffle_seed: expected int"):
        check(CONF, ["data.shuffle_seed=abc"])
    with pytest.raises(ConfigError, match="data.eval_split: expected str or null"):
        check(CONF, ["data.eval_split=[1]"])
    with pytest.raises(ConfigError, match="data.window: unknown key; did you mean 'windows'"):
        check(CONF, ["data=memmap", "+data.window=random"])
    with pytest.raises(ConfigError, match="data.windows: expected one of 'random', 'sequential'"):
        check(CONF, ["data=memmap", "data.windows=shuffled"])
    with pytest.raises(
        ConfigError, match="data.eval_datasets.code.remot: unknown key; did you mean 'remote'"
    ):
        check(CONF, ["data.eval_datasets={code: {remot: 'data/code'}}"])
    with pytest.raises(ConfigError, match="data.eval_datasets.code.shuffle_seed: expected int"):
        check(CONF, ["data=memmap", "data.eval_datasets={code: {shuffle_seed: abc}}"])
    check(CONF, ["data.eval_datasets={eos: {sequence_id_from_eos: 0}, code: 'data/code'}"])
    check(CONF, ["data=finetune", "data.sequence_id_from_eos=auto"])
    check(
        CONF,
        ["data=memmap", "data.split_files={train: a.bin, val: b.bin}", "data.val_fraction=null"],
    )


def test_tensor_parallelism_pads_every_split_to_a_multiple_of_tp(root: Path):
    """build_trainer passes parallelism.tp: the train and eval batches' widths are multiples."""
    data = build_loaders(
        group(remote=str(root)), batch_size=8, eval_batch_size=4, max_seq_len=15,
        pad_to_multiple_of=4,
    )  # fmt: skip
    for loader in (data.train, *data.evals.values()):
        batch = next(iter(loader))
        assert batch["input_ids"].shape[1] == 16 and batch["labels"][:, 15].eq(-100).all()
