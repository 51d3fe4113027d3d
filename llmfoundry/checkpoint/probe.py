"""What a load path names: a checkpoint folder, or a save folder's checkpoint to continue from;
and, when it names neither, a one-line error saying what it is instead (a damaged checkpoint, a
transformers folder, nothing).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from llmfoundry.checkpoint.catalogue import (
    MODEL_FILE,
    STATE_FILE,
    latest_checkpoint,
    newest_damage,
)
from llmfoundry.checkpoint.manifest import MANIFEST, CheckpointError, describe
from llmfoundry.utils import storage
from llmfoundry.utils.errors import MissingInput
from llmfoundry.utils.files import join_url

HF_CONFIG = "config.json"  # what a transformers folder has and a checkpoint has not


def resolve(path: str) -> str:
    """A checkpoint folder, or a save folder (its checkpoint to continue from) -> the checkpoint
    folder."""
    with reading(path):
        fs, root = storage.url_to_fs(path)
        if fs.exists(join_url(root, STATE_FILE)) or fs.exists(join_url(root, MANIFEST)):
            return path
        latest = latest_checkpoint(path) if fs.isdir(root) else None
    if latest is not None:
        return latest
    if damage := newest_damage(path):
        raise CheckpointError(
            f"load_path {path} holds no complete checkpoint: {damage}; copy that checkpoint "
            "again if it came from elsewhere, or point load_path at an earlier checkpoint folder"
        )
    if fs.exists(join_url(root, HF_CONFIG)):
        raise CheckpointError(
            f"load_path {path} is a transformers folder, not a llmfoundry checkpoint; convert it "
            f"first with `python scripts/import_hf.py {path} CKPT_DIR` and point load_path at CKPT_DIR"
        )
    if fs.isfile(root):
        raise CheckpointError(
            f"load_path {path} is a file, and the only checkpoint files llmfoundry reads are "
            "Composer's torch zip files on this machine; decompress a compressed Composer "
            "checkpoint (.tar.gz, .lz4, .zst) first, and copy one from an object store here"
        )
    raise MissingInput(
        f"load_path {path!r} is neither a checkpoint folder (with {MODEL_FILE} and "
        f"{STATE_FILE}), a save folder with a complete checkpoint, nor a Composer checkpoint "
        "(ep<E>-ba<B>-rank0.pt, or its sharded folder); point it at a folder like "
        "<save_folder>/ep0-ba100, at the save_folder itself, or at a Composer checkpoint"
    )


@contextlib.contextmanager
def reading(url: str) -> Iterator[None]:
    """An object store or web server that does not answer is one line naming `url`."""
    try:
        yield
    except Exception as err:
        if storage.is_local(url) or not storage.is_unreachable(err):
            raise
        raise CheckpointError(
            f"cannot read the checkpoint at {url} ({describe(err)}); {storage.UNREACHABLE_FIX}"
        ) from None
