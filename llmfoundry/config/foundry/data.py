"""llm-foundry's train_loader, eval_loader and eval_loaders as our data group.

Their `text` dataset reads MDS token shards at ``<remote or local>/<split>``, as ours does
(`data=mds`: data_prep's shards are read by both). Their `finetuning` dataset reads either
MDS (remote/local: `data=finetune`, our instruction rows from data_prep/instructions_to_mds.py)
or a local .jsonl file of {prompt, response} or {messages} examples (``hf_name: json`` with
``hf_kwargs.data_files``, or ``hf_name: <folder>`` holding ``<split>.jsonl``), converted before
the run to our instruction rows in a folder named after the file (`Prep`). The eval loader
reads the same data as the train loader, at its own split; eval_loaders' other datasets become
`data.eval_datasets` by label.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from llmfoundry.config.foundry.common import check_known, only, refuse, section
from llmfoundry.config.foundry.native import Native, Prep, Whole

# Loader keys (torch DataLoader's, which llm-foundry passes on) -> ours.
_LOADER = {"drop_last", "num_workers", "pin_memory", "prefetch_factor", "timeout"}
# MDS dataset keys with the same meaning here (streaming's StreamingDataset -> ours).
_SAME = {
    "shuffle_seed": "shuffle_seed",
    "shuffle_block_size": "shuffle_block_size",
    "num_canonical_nodes": "canonical_nodes",
    "predownload": "predownload",
    "cache_limit": "cache_limit",
    "download_retry": "download_retry",
    "validate_hash": "validate_hash",
    "keep_zip": "keep_zip",
    "epoch_size": "epoch_size",
    "allow_unsafe_types": "allow_unsafe",
}
# Streaming's defaults that are also our only behaviour.
_DEFAULT_ONLY = {
    "partition_algo": "relaxed",
    "sampling_method": "balanced",
    "sampling_granularity": 1,
    "batching_method": "random",
    "replication": None,
    "stream_name": "stream",
    "stream_config": None,
    "eos_token_id": None,
}
_NOTED = {
    "shuffle_algo": "samples are shuffled in blocks here (shuffle_block_size, shuffle_seed); "
    "the order differs from streaming's algorithm",
    "download_timeout": "downloads here retry download_retry times without a timeout of their own",
    "token_encoding_type": "the shards' index records their token dtype",
    "persistent_workers": "workers here live for the whole run",
}
_TEXT_KEYS = {"remote", "local", "split", "streams", "shuffle", "max_seq_len"}
_TEXT_KEYS |= set(_SAME) | set(_DEFAULT_ONLY) | set(_NOTED)
_FINETUNING_KEYS = _TEXT_KEYS | {
    "hf_name",
    "hf_kwargs",
    "preprocessing_fn",
    "decoder_only_format",
    "allow_pad_trimming",
    "packing_ratio",
    "target_prompts",
    "target_responses",
    "safe_load",
}
_STREAM_KEYS = {"remote", "local", "split", "proportion", "repeat", "choose", "download_retry"}


def loaders(cfg: Mapping[str, Any], out: Native, prep_root: str) -> None:
    train = section(cfg, "train_loader")
    kind = train.get("name")
    if kind not in ("text", "finetuning"):
        raise refuse("train_loader.name", f"{kind!r}: text and finetuning datasets are supported")
    check_known("train_loader", train, {"name", "dataset", *_LOADER, "persistent_workers"})
    out.groups["data"] = "mds" if kind == "text" else "finetune"
    dataset = _dataset("train_loader", train, cfg, out, prep_root)
    for key in _LOADER:
        if key in train:
            out.set(f"data.{key}", train[key])
    _evals(cfg, dataset, out)


def _dataset(
    where: str, loader: Mapping[str, Any], cfg: Mapping[str, Any], out: Native, prep_root: str
) -> dict[str, Any]:
    """Map the train loader's dataset onto data.*; return its source (remote, local, streams)."""
    kind, node = loader["name"], dict(loader.get("dataset") or {})
    if "persistent_workers" in loader:
        out.note(f"{where}.persistent_workers", _NOTED["persistent_workers"])
    where = f"{where}.dataset"
    check_known(where, node, _TEXT_KEYS if kind == "text" else _FINETUNING_KEYS)
    _check_seq_len(where, node, cfg)
    for key, default in _DEFAULT_ONLY.items():
        if key in node:
            only(f"{where}.{key}", node[key], default, "the only behaviour here")
    for key, why in _NOTED.items():
        if key in node:
            out.note(f"{where}.{key}", why)
    if kind == "finetuning":
        _finetuning(where, node, cfg, out, prep_root)
    node["split"] = _split(node)
    source = _source(where, node)
    for key, value in source.items():
        out.set(f"data.{key}", Whole(value) if isinstance(value, dict) else value)
    out.set("data.train_split", node["split"] or "train")
    out.set("data.shuffle", bool(node.get("shuffle", False)))
    for theirs, ours in _SAME.items():
        if theirs in node:
            out.set(f"data.{ours}", node[theirs])
    return source


def _check_seq_len(where: str, node: Mapping[str, Any], cfg: Mapping[str, Any]) -> None:
    if "max_seq_len" in node and node["max_seq_len"] != cfg.get("max_seq_len"):
        raise refuse(
            f"{where}.max_seq_len",
            f"{node['max_seq_len']} differs from max_seq_len={cfg.get('max_seq_len')}; here one "
            "max_seq_len sets the rows' length: make them equal",
        )


def _split(node: Mapping[str, Any]) -> str | None:
    """The loader's split: dataset.split, else the one split its streams name."""
    splits = {dict(s).get("split") for s in dict(node.get("streams") or {}).values()} - {None}
    if node.get("split") is None and len(splits) == 1:
        return splits.pop()
    return node.get("split")


def _source(where: str, node: Mapping[str, Any]) -> dict[str, Any]:
    """remote/local/streams as ours: a local-only dataset is read in place (our remote)."""
    if node.get("streams"):
        streams = {}
        for name, stream in dict(node["streams"]).items():
            stream = dict(stream)
            check_known(f"{where}.streams.{name}", stream, _STREAM_KEYS)
            if stream.pop("split", None) not in (None, node.get("split")):
                raise refuse(
                    f"{where}.streams.{name}.split",
                    "every stream is read at the loader's split here; give it as dataset.split",
                )
            if not stream.get("remote"):
                stream["remote"], stream["local"] = stream.get("local"), None
            streams[str(name)] = {k: v for k, v in stream.items() if v is not None}
        return {"remote": None, "local": None, "streams": streams}
    remote, local = node.get("remote"), node.get("local")
    if not remote and not local:
        raise refuse(f"{where}.remote", "give remote or local (the folder holding the splits)")
    return {"remote": remote or local, "local": local if remote else None, "streams": None}


def _finetuning(
    where: str, node: dict[str, Any], cfg: Mapping[str, Any], out: Native, prep_root: str
) -> None:
    """Finetuning specifics; a local .jsonl becomes instruction MDS made before the run."""
    only(
        f"{where}.decoder_only_format",
        node.pop("decoder_only_format", True),
        True,
        "encoder-decoder models (T5) are not supported here",
    )
    if node.pop("preprocessing_fn", None) is not None:
        raise refuse(
            f"{where}.preprocessing_fn",
            "no code is run from a config here; write the examples as .jsonl lines of "
            '{"prompt": ..., "response": ...} and give hf_name: json with hf_kwargs.data_files',
        )
    for key, value in (("target_prompts", "none"), ("target_responses", "last")):
        only(f"{where}.{key}", node.pop(key, value), value, "only responses count here")
    if node.pop("allow_pad_trimming", None) is not None:
        out.note(f"{where}.allow_pad_trimming", "rows are fixed-length here: no trimming")
    node.pop("safe_load", None)  # our reader never runs code: always "safe"
    packing = node.pop("packing_ratio", None)
    hf_name = node.pop("hf_name", None)
    kwargs = dict(node.pop("hf_kwargs", None) or {})
    if hf_name is None:
        out.note(where, "reads instruction MDS rows from data_prep/instructions_to_mds.py")
        if packing is not None:
            out.note(f"{where}.packing_ratio", "rows were packed (or not) when they were made")
        return
    split = node.get("split") or "train"
    jsonl = _jsonl_file(where, hf_name, kwargs, split)
    tokenizer = section(cfg, "tokenizer").get("name")
    options = {"tokenizer": tokenizer, "seq_len": cfg.get("max_seq_len")}
    if packing is None:
        options["no_pack"] = ""
    target = str(Path(prep_root, _digest(jsonl, options)))
    out.prep.append(Prep("instructions", jsonl, target, options))
    node["remote"], node["local"], node["split"] = target, None, "train"


def _jsonl_file(where: str, hf_name: str, kwargs: Mapping[str, Any], split: str) -> str:
    """The local .jsonl file of split `split` named by hf_name/hf_kwargs, or a refusal."""
    if hf_name == "json":
        check_known(f"{where}.hf_kwargs", kwargs, {"data_files"})
        files = kwargs.get("data_files")
        if isinstance(files, Mapping):
            files = files.get(split)
        if not isinstance(files, str):
            raise refuse(
                f"{where}.hf_kwargs.data_files",
                f"give one local .jsonl file for split {split!r} (a path, or {{{split}: path}})",
            )
        path = files
    elif os.path.isdir(hf_name):
        path = os.path.join(hf_name, f"{split}.jsonl")
    else:
        raise refuse(
            f"{where}.hf_name",
            f"{hf_name!r} is a Hugging Face Hub dataset, and nothing is downloaded from the Hub "
            "here; save it as .jsonl ({prompt, response} lines) and give hf_name: json with "
            "hf_kwargs.data_files: <file>",
        )
    if not os.path.isfile(path):
        raise refuse(f"{where}.hf_name", f"{path} not found: the .jsonl file of split {split!r}")
    return os.path.abspath(path)


def _digest(path: str, options: Mapping[str, Any]) -> str:
    """A folder name for the rows made from `path` with `options` (same inputs, same folder:
    instructions_to_mds reuses what it wrote)."""
    text = repr((path, sorted(options.items())))
    return "instructions-" + hashlib.sha256(text.encode()).hexdigest()[:16]


_EVAL_SOURCE = {"remote", "local", "streams", "split", "max_seq_len"}


def _note_eval_settings(
    where: str, loader: Mapping[str, Any], node: Mapping[str, Any], out: Native
) -> None:
    """An eval loader's own settings, which evaluation here does not take (one note)."""
    keys = sorted(set(loader) - {"name", "dataset"}) + sorted(
        f"dataset.{k}" for k in set(node) - _EVAL_SOURCE
    )
    if keys:
        out.note(
            f"{where}.{{{','.join(keys)}}}",
            "evaluation reads every sample once, in order, with train_loader's loader settings",
        )


def _evals(cfg: Mapping[str, Any], train_source: Mapping[str, Any], out: Native) -> None:
    """eval_loader / eval_loaders: the one reading the train data is our eval_split; others
    (by label) are data.eval_datasets, read at that split."""
    single, many = cfg.get("eval_loader"), cfg.get("eval_loaders")
    if single is not None and many is not None:
        raise refuse("eval_loaders", "give eval_loader or eval_loaders, not both")
    if isinstance(single, list):  # llm-foundry takes a list under eval_loader too
        single, many = None, single
    loaders = [("eval_loader", dict(single))] if single is not None else []
    for i, loader in enumerate(many or []):
        loaders.append((f"eval_loaders[{i}]", dict(loader)))
    if not loaders:
        out.set("data.eval_split", None)
        return
    split, main, extra = None, False, {}
    for where, loader in loaders:
        label = loader.pop("label", None)
        check_known(where, loader, {"name", "dataset", *_LOADER, "persistent_workers"})
        node = dict(loader.get("dataset") or {})
        check_known(f"{where}.dataset", node, _FINETUNING_KEYS)
        if node.get("hf_name") is not None:
            raise refuse(
                f"{where}.dataset.hf_name",
                "evaluation reads instruction rows made beforehand here: make train and val "
                "rows at once (python data_prep/instructions_to_mds.py FILE --val-fraction 0.05 "
                "--tokenizer TOK --seq-len N --out DIR) and give the loaders dataset.remote: DIR",
            )
        _check_seq_len(f"{where}.dataset", node, cfg)
        _note_eval_settings(where, loader, node, out)
        node["split"] = _split(node)
        source = _source(f"{where}.dataset", node)
        this = node["split"] or "val"
        if split is not None and this != split:
            raise refuse(f"{where}.dataset.split", f"{this!r}: every eval set reads {split!r} here")
        split = this
        if source == dict(train_source) and not main:
            out.set("data.eval_split", this)
            main = True
            continue
        if not label:
            raise refuse(
                f"{where}.dataset",
                "evaluates other data than train_loader: give it a label in eval_loaders "
                "(a train-data eval_loader comes first)",
            )
        extra[str(label)] = Whole({k: v for k, v in source.items() if v is not None})
    if not main:
        raise refuse(
            loaders[0][0],
            "here evaluation reads the train data's eval split first; add an eval loader "
            "of the train_loader's dataset",
        )
    if extra:
        out.set("data.eval_datasets", Whole(extra))
