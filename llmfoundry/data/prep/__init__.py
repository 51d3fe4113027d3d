"""Data preparation: text -> token stream (memmap) -> MDS shards, plus verify and merge, and
token streams made elsewhere (adopt.py).

The command-line scripts in ``data_prep/`` are thin wrappers over these functions.
"""

from llmfoundry.data.meta import bytes_per_token
from llmfoundry.data.prep.adopt import adopt_tokens, open_token_file
from llmfoundry.data.prep.mds_tools import (
    IndexReport,
    find_indexes,
    merge_folders,
    merge_indexes,
    verify_mds,
)
from llmfoundry.data.prep.sources import Task, iter_documents, plan_tasks, read_task
from llmfoundry.data.prep.text_to_tokens import (
    open_doc_index,
    open_tokens,
    sidecar_path,
    text_to_tokens,
)
from llmfoundry.data.prep.tokens_to_mds import split_rows, tokens_to_mds
from llmfoundry.tokenizers.tokenizer import (
    EOS_TOKEN,
    PreparedTokenizer,
    load_tokenizer,
    prepare_tokenizer,
    token_byte_lengths,
    train_bpe,
)

__all__ = [
    "EOS_TOKEN",
    "adopt_tokens",
    "bytes_per_token",
    "IndexReport",
    "PreparedTokenizer",
    "Task",
    "find_indexes",
    "iter_documents",
    "load_tokenizer",
    "merge_folders",
    "merge_indexes",
    "open_doc_index",
    "open_token_file",
    "open_tokens",
    "plan_tasks",
    "prepare_tokenizer",
    "read_task",
    "sidecar_path",
    "split_rows",
    "text_to_tokens",
    "token_byte_lengths",
    "tokens_to_mds",
    "train_bpe",
    "verify_mds",
]
