"""MDS (Mosaic Data Shards): read and write datasets compatible with mosaicml-streaming.

Modules: encodings (column values), compression and hashing (shard files), index (index.json),
reader (one local shard, mmap) and writer (a whole dataset, to a local folder or fsspec URL).
"""

from llmfoundry.data.mds.compression import compress, decompress, extension, is_compression
from llmfoundry.data.mds.encodings import (
    ENCODING_NAMES,
    Encoding,
    NDArray,
    UnsafeEncodingError,
    decode,
    encode,
    encoding_size,
    get_encoding,
    is_encoding,
)
from llmfoundry.data.mds.hashing import HASH_NAMES, digest, fastest, file_digest, is_hash
from llmfoundry.data.mds.index import (
    INDEX_NAME,
    FileInfo,
    ShardInfo,
    check_basename,
    dump_index,
    load_index,
    parse_index,
    write_index,
)
from llmfoundry.data.mds.reader import (
    ShardCorruptError,
    ShardReader,
    unpack_shard,
    verify_file,
    verify_shard,
)
from llmfoundry.data.mds.writer import MDSWriter

__all__ = [
    "ENCODING_NAMES",
    "HASH_NAMES",
    "INDEX_NAME",
    "Encoding",
    "FileInfo",
    "MDSWriter",
    "NDArray",
    "ShardCorruptError",
    "ShardInfo",
    "ShardReader",
    "UnsafeEncodingError",
    "check_basename",
    "compress",
    "decode",
    "decompress",
    "digest",
    "fastest",
    "dump_index",
    "encode",
    "encoding_size",
    "extension",
    "file_digest",
    "get_encoding",
    "is_compression",
    "is_encoding",
    "is_hash",
    "load_index",
    "parse_index",
    "unpack_shard",
    "verify_file",
    "verify_shard",
    "write_index",
]
