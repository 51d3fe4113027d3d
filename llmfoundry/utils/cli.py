"""What every script's and data_prep script's command line shares: ``--debug`` and ``--storage``.

``--storage`` takes the training config's ``storage:`` block (a YAML/JSON file, or inline such as
``'{options: {endpoint_url: http://localhost:9000}}'``), so ``s3://`` URLs of a MinIO, R2 or
moto store reach the same endpoint in data_prep and mds_tools as in training. Problems a user
can fix end as one line and exit status 2 (`llmfoundry.utils.errors`); ``--debug`` shows their
traceback. Every entry point (scripts/*.py, data_prep/*.py) reports errors this way;
scripts/train.py, whose command line is Hydra's, calls `exit_on_user_error` itself.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

from llmfoundry.utils import storage
from llmfoundry.utils.errors import DEBUG_ENV, exit_on_user_error, split_debug_flag

__all__ = ["add_script_arguments", "add_storage_argument", "script_errors"]


def add_storage_argument(parser: argparse.ArgumentParser) -> None:
    """``--storage`` alone, for a script with error handling of its own (scripts/serve.py)."""
    parser.add_argument(
        "--storage",
        metavar="SETTINGS",
        help="object-store settings for remote URLs, as the training config's storage: block: "
        "a YAML/JSON file or inline, e.g. '{options: {endpoint_url: http://localhost:9000}}' "
        "(default: the environment, e.g. AWS_ENDPOINT_URL, AWS_PROFILE, FSSPEC_S3_*)",
    )


def add_script_arguments(parser: argparse.ArgumentParser, storage: bool = True) -> None:
    """``--debug``, and ``--storage`` unless the script reads and writes local files only."""
    if storage:
        add_storage_argument(parser)
    parser.add_argument(
        "--debug", action="store_true", help=f"show the traceback of errors (or {DEBUG_ENV}=1)"
    )


@contextlib.contextmanager
def script_errors(
    args: argparse.Namespace, also: tuple[type[BaseException], ...] = (), prefix: str = "error"
) -> Iterator[None]:
    """Apply ``--storage``, then run the block with user errors (and ``also``) as one line that
    starts with ``prefix``."""
    _, debug = split_debug_flag(["--debug"] if args.debug else [])
    with exit_on_user_error(debug, prefix=prefix, also=also):
        if getattr(args, "storage", None):
            storage.configure_settings(storage.load_settings(args.storage))
        yield
