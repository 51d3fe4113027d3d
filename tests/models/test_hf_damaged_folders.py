"""A damaged or hostile transformers folder given to scripts/import_hf.py (the same `from_hf` that
generate.py, eval.py and serve.py load a folder through): one line naming the file or key and the
fix, exit 2, and no code from the folder runs."""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from llmfoundry.checkpoint.pretrained import read_pretrained
from llmfoundry.utils.errors import UserError
from tests.utils.test_entry_points import main_of, one_line_error

LLAMA = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
LLAMA |= dict(num_hidden_layers=1, vocab_size=64, max_position_embeddings=64)
MPT = dict(d_model=32, n_heads=2, n_layers=1, vocab_size=64, max_seq_len=16)
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A tiny random transformers Llama and MPT folder, as save_pretrained writes them."""
    out = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(out / "llama")
    transformers.MptForCausalLM(transformers.MptConfig(**MPT)).save_pretrained(out / "mpt")
    return {"llama": out / "llama", "mpt": out / "mpt"}


def _config(**fields) -> Callable[[Path], None]:
    """Set (None: remove) keys of config.json."""

    def edit(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        for key, value in fields.items():
            config.pop(key) if value is None else config.__setitem__(key, value)
        (folder / "config.json").write_text(json.dumps(config))

    return edit


def _tensors(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def rewrite(folder: Path) -> None:
        tensors = load_file(folder / WEIGHTS)
        edit(tensors)
        save_file(tensors, folder / WEIGHTS, metadata={"format": "pt"})

    return rewrite


def _bytes(edit: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    return lambda folder: (folder / WEIGHTS).write_bytes(edit((folder / WEIGHTS).read_bytes()))


class _RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {_RunsCode.marker}",))

    marker = ""


def _pickle_that_runs_code(folder: Path) -> None:
    (folder / WEIGHTS).unlink()
    torch.save({"model.norm.weight": _RunsCode()}, folder / "pytorch_model.bin")


def _reshape_embedding(tensors: dict[str, torch.Tensor]) -> None:
    key = next(k for k in tensors if k.endswith(("embed_tokens.weight", "wte.weight")))
    tensors[key] = torch.zeros(3, 3)


def _header_lie(data: bytes) -> bytes:
    (length,) = struct.unpack("<Q", data[:8])
    return struct.pack("<Q", length + 10**6) + data[8:]


CASES = {
    "pickle_that_runs_code": ("llama", _pickle_that_runs_code, "pytorch_model.bin): its pickle"),
    "heads_0": ("llama", _config(num_attention_heads=0), "num_attention_heads=0, not a positive"),
    "mpt_heads_0": ("mpt", _config(n_heads=0), "config.json: n_heads=0, not a positive integer"),
    "kv_heads_negative": ("llama", _config(num_key_value_heads=-2), "num_key_value_heads=-2"),
    "vocab_0": ("llama", _config(vocab_size=0), "vocab_size=0, not a positive integer"),
    "heads_a_string": ("llama", _config(num_attention_heads="4"), "num_attention_heads='4'"),
    "no_hidden_size": ("llama", _config(hidden_size=None), "config.json has no 'hidden_size'"),
    "wrong_shape": (
        "llama",
        _tensors(_reshape_embedding),
        "tensor model.embed_tokens.weight has shape [3, 3], but config.json makes it [64, 32]",
    ),
    "mpt_wrong_shape": ("mpt", _tensors(_reshape_embedding), "transformer.wte.weight has shape"),
    "missing_tensor": (
        "llama",
        _tensors(lambda t: t.pop("model.norm.weight")),
        "the weights lack model.norm.weight",
    ),
    "extra_tensor": (
        "mpt",
        _tensors(lambda t: t.__setitem__("transformer.extra", torch.zeros(2))),
        "no place for: transformer.extra",
    ),
    "safetensors_header_lie": ("llama", _bytes(_header_lie), "cannot read its weights"),
    "safetensors_truncated": ("mpt", _bytes(lambda b: b[: len(b) // 2]), "cannot read its weights"),
    "no_weights": ("llama", lambda f: (f / WEIGHTS).unlink(), "(no weights file): cannot read"),
    "config_not_json": (
        "llama",
        lambda f: (f / "config.json").write_text("{not json"),
        "not a readable transformers config.json",
    ),
    "config_huge": (
        "llama",
        lambda f: (f / "config.json").write_text(json.dumps({"x": "a" * (2 << 20)})),
        "more than a transformers config.json holds",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_damaged_folder_is_one_line(case, folders, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LLMFOUNDRY_DEBUG", raising=False)
    family, damage, names = CASES[case]
    folder = tmp_path / "hf"
    shutil.copytree(folders[family], folder)
    _RunsCode.marker = str(tmp_path / "ran")
    damage(folder)
    line = one_line_error(
        capsys, main_of("scripts/import_hf.py"), [str(folder), str(tmp_path / "o")]
    )
    assert names in line and ("again" in line or "safetensors export" in line), line
    assert not (tmp_path / "ran").exists() and not (tmp_path / "o").exists()


def test_generate_and_serve_read_a_folder_the_same_way(folders, tmp_path):
    """read_pretrained (generate.py, eval.py, serve.py) takes the checked path too."""
    folder = tmp_path / "hf"
    shutil.copytree(folders["llama"], folder)
    _config(num_attention_heads=0)(folder)
    with pytest.raises(UserError, match="num_attention_heads=0"):
        read_pretrained(str(folder))
