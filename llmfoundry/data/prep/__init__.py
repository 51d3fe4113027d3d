"""Data preparation: text -> token stream (memmap) -> MDS shards, plus verify and merge.

The command-line scripts in ``data_prep/`` are thin wrappers over these functions.
"""

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
from llmfoundry.data.prep.tokenizer import (
    EOS_TOKEN,
    PreparedTokenizer,
    load_tokenizer,
    prepare_tokenizer,
    token_byte_lengths,
    train_bpe,
)
from llmfoundry.data.prep.tokens_to_mds import bytes_per_token, split_rows, tokens_to_mds

__all__ = [
    "EOS_TOKEN",
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
