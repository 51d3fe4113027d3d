"""Cache folders that only their user can write: anyone who can write in a cache can plant shards.

A cache's shards are trained on as they are (each is hashed once per process, cache.py, but
index.json and the launch's metadata copies sit in the same folder). So a cache folder, and the
per-user root of the default ones, must belong to the user running and be writable by nobody
else; otherwise the first user of a shared machine to create ``<tmp>/<cache>`` could serve
their shards to everyone who reads the same remote. Folders created here get mode 0700.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from llmfoundry.utils.errors import UserError

__all__ = ["private_folder"]

_FIX = "set local (data.local in a training config) to a folder of your own"


def private_folder(folder: Path) -> Path:
    """Create ``folder`` (mode 0700; missing parents get the umask's) if absent; raise UserError
    unless it (and the folder a symlink points to) belongs to this user and only they can write
    in it."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    uid = os.geteuid()
    link, target = os.lstat(folder), os.stat(folder)
    owner = next((s.st_uid for s in (link, target) if s.st_uid != uid), None)
    if owner is not None:
        raise UserError(
            f"cache folder {folder} belongs to uid {owner}, not to this user (uid {uid}), who "
            f"could plant shards in it; {_FIX}, or have its owner delete it"
        )
    if target.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        mode = stat.S_IMODE(target.st_mode)
        raise UserError(
            f"cache folder {folder} is writable by group/others (mode {mode:o}), who could plant "
            f"shards in it; `chmod go-w {folder}` if only you wrote there (else delete it), or "
            f"{_FIX}"
        )
    return folder
