"""Cache folders that only their user can write: anyone who can write in a cache can plant shards.

A cache's shards are trained on as they are (each is hashed once per process, cache.py, but
index.json and the launch's metadata copies sit in the same folder). So a cache folder, and the
per-user root of the default ones, must belong to the user running and be writable by nobody
else; otherwise the first user of a shared machine to create ``<tmp>/<cache>`` could serve
their shards to everyone who reads the same remote. Folders created here get mode 0700.

Group write is allowed only for the user's private group (named after the user, no other
members): distributions that give each user such a group also set umask 002, so every folder a
user makes by hand is group-writable, and only the user is in that group.
"""

from __future__ import annotations

import grp
import os
import pwd
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
    writers = stat.S_IWOTH | (0 if _private_group(target.st_gid) else stat.S_IWGRP)
    if target.st_mode & writers:
        mode = stat.S_IMODE(target.st_mode)
        raise UserError(
            f"cache folder {folder} is writable by group/others (mode {mode:o}), who could plant "
            f"shards in it; `chmod go-w {folder}` if only you wrote there (else delete it), or "
            f"{_FIX}"
        )
    return folder


def _private_group(gid: int) -> bool:
    """Whether group ``gid`` is this user's private group: named after the user, no other member."""
    try:
        user, group = pwd.getpwuid(os.geteuid()).pw_name, grp.getgrgid(gid)
    except KeyError:  # a uid or gid without a name (containers): not known to be private
        return False
    return group.gr_name == user and set(group.gr_mem) <= {user}
