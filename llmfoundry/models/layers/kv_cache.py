"""The decoding state of a causal LM (any family): what a forward over new tokens needs from earlier ones.

Decoding one token at a time would otherwise rerun the whole prefix at every step. With a
`KVCache`, a model's `forward(new_ids, sequence_id, cache=cache)` projects only the new
tokens, appends their keys and values to each layer's cache and attends over all of them. The
attention kernels need nothing more: queries are the last of the key positions (see
`attention.py`), so ALiBi, causality, the sliding window and document masking line up as in a
full forward.

Infini-attention layers keep their own state instead (`InfiniState`): the compressive memory of
the completed segments and the keys and values of the current one, so memory stays bounded by
one segment however long the text grows.

Buffers are allocated once for `max_len` positions and filled in place, so a step copies only
the new keys, not the whole cache.

A forward takes any `Keys`, of which `KVCache` is one: the keys its queries attend to besides
their own. A context-parallel rank's (llmfoundry/distributed/context.py) are the other ranks'
parts of the same sequence, gathered in each layer; there the forward's tokens are not the last
of the keys, and `Keys.queries` says where they are. The model takes positions and the mask
from it (`attend_over`) and knows nothing of where the other keys come from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class Keys(Protocol):
    """The keys a forward's queries attend to besides their own, and where those queries are.

    `length`: how many keys there are besides this forward's; `extend(sequence_id, seq_len)`
    adds this forward's `seq_len` and returns the document ids of all keys (or None); `layers`:
    per block, an object whose `append(k, v)` takes the block's new keys and values [B,
    kv_heads, seq_len, D] and returns all of them in position order; `queries(seq_len,
    device)`: the positions of this forward's tokens among all keys (LongTensor [seq_len],
    ascending), or None for the last seq_len (a cache of earlier tokens)."""

    length: int

    @property
    def layers(self) -> Sequence[Any]: ...

    def extend(self, sequence_id: torch.Tensor | None, seq_len: int) -> torch.Tensor | None: ...

    def queries(self, seq_len: int, device: torch.device) -> torch.Tensor | None: ...


def attend_over(
    keys: Keys | None, sequence_id: torch.Tensor | None, seq_len: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """What a forward of `seq_len` tokens attends over: the document ids of every key (None:
    no documents), the positions of its queries among the keys (None: the last seq_len) and
    the number of keys. Without `keys`, its own tokens alone."""
    if keys is None:
        return sequence_id, None, seq_len
    past = keys.length
    sequence_id = keys.extend(sequence_id, seq_len)
    return sequence_id, keys.queries(seq_len, device), past + seq_len


class LayerKV:
    """One attention layer's keys and values so far, in buffers of `max_len` positions."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.length = 0
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, kv_heads, n, D] after the earlier ones; return all of them (views)."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(
                f"the KV cache holds {self.max_len} positions and is full; make a KVCache with "
                f"a larger max_len (needed: {end})"
            )
        if self.k is None:
            shape = (k.shape[0], k.shape[1], self.max_len, k.shape[3])
            self.k = k.new_empty(shape)
            self.v = v.new_empty((*shape[:3], v.shape[3]))
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` (a LongTensor of indices)."""
        if self.k is not None:
            self.k, self.v = self.k[rows], self.v[rows]

    def join(self, other: LayerKV, length: int, max_len: int) -> None:
        """Append `other`'s rows to the batch; both are first right-aligned at `length`
        positions (zeros before their own) in buffers of `max_len`."""
        self.k = torch.cat(
            [
                _aligned(self.k, self.length, length, max_len),
                _aligned(other.k, other.length, length, max_len),
            ]
        )
        self.v = torch.cat(
            [
                _aligned(self.v, self.length, length, max_len),
                _aligned(other.v, other.length, length, max_len),
            ]
        )
        self.length, self.max_len = length, max_len


def _aligned(t: torch.Tensor, used: int, length: int, max_len: int) -> torch.Tensor:
    """t's first `used` positions moved to end at `length`, in a zeroed buffer of `max_len`."""
    out = t.new_zeros((*t.shape[:2], max_len, t.shape[3]))
    out[:, :, length - used : length] = t[:, :, :used]
    return out


@dataclass
class InfiniState:
    """One infini-attention layer's state between forwards.

    `memory` [B, kv_heads, D, Dv] and `norm` [B, kv_heads, D] (float32) hold the segments before
    the current one; `k`, `v` [B, kv_heads, n, D] are the current segment's first n positions
    (n == segment_len: complete, folded into the memory when the next token arrives).
    """

    memory: torch.Tensor | None = None
    norm: torch.Tensor | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    def select(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` (a LongTensor of indices)."""
        for name in ("memory", "norm", "k", "v"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value[rows])


def _padded_ids(cache: KVCache, length: int) -> torch.Tensor:
    """`cache`'s document ids left-padded with 0 to `length` (ones where it had none)."""
    buffer = cache.layers[0].k
    ids = torch.zeros(buffer.shape[0], length, dtype=torch.long, device=buffer.device)
    ids[:, length - cache.length :] = 1 if cache.sequence_id is None else cache.sequence_id
    return ids


@dataclass
class KVCache:
    """The state of every layer of one batch of sequences, and the document ids seen so far.

    `sequence_id` [B, length] (None: no document masking, e.g. no padding) covers every cached
    position; a forward with the cache passes the new tokens' ids and the model attends with the
    concatenation. Make one per batch with `KVCache.empty(n_layers, max_len, recurrent)`
    (for a model: `llmfoundry.models.generation.new_cache(model, max_len)`).
    """

    layers: list[LayerKV | InfiniState]
    max_len: int
    length: int = 0
    sequence_id: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def empty(cls, n_layers: int, max_len: int, recurrent: bool = False) -> KVCache:
        """An empty cache of `n_layers` layers holding up to `max_len` positions: one key/value
        buffer per layer, or, `recurrent`, infini-attention's memory (its caller asks the
        model's family: `llmfoundry.models.generation.new_cache`)."""
        layers = [InfiniState() if recurrent else LayerKV(max_len) for _ in range(n_layers)]
        return cls(layers, max_len)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` (a LongTensor of indices): the others are done."""
        for layer in self.layers:
            layer.select(rows)
        if self.sequence_id is not None:
            self.sequence_id = self.sequence_id[rows]

    def join(self, other: KVCache) -> None:
        """Add the rows of `other` (another batch of the same model) to this batch.

        The shorter of the two is left-padded with empty positions whose document id is 0 (so
        every later forward passes `sequence_id`: 1 for real tokens), which no real token attends
        to; ALiBi is relative, and learned positions count from each row's first real token, so
        neither row sees a difference. Each row keeps the room it had left.
        """
        if any(not isinstance(layer, LayerKV) for layer in (*self.layers, *other.layers)):
            raise ValueError("only key/value caches join (infini-attention rows are not padded)")
        if self.length == 0 or other.length == 0:
            raise ValueError("both caches must hold positions to join (run the prompts first)")
        length = max(self.length, other.length)
        max_len = length + max(self.max_len - self.length, other.max_len - other.length)
        plain = all(c.sequence_id is None and c.length == length for c in (self, other))
        ids = None if plain else torch.cat([_padded_ids(c, length) for c in (self, other)])
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            mine.join(theirs, length, max_len)
        self.sequence_id = ids
        self.length, self.max_len = length, max_len

    def extend(self, sequence_id: torch.Tensor | None, new_len: int) -> torch.Tensor | None:
        """Record `new_len` more positions; return the document ids of all positions, or None.

        Mixing calls with and without `sequence_id` is refused: the positions before would have
        no ids.
        """
        if self.length + new_len > self.max_len:
            raise ValueError(
                f"the KV cache holds {self.max_len} positions; {self.length} are used and "
                f"{new_len} more were given; make a KVCache with a larger max_len"
            )
        if (sequence_id is None) != (self.sequence_id is None) and self.length:
            raise ValueError(
                "pass sequence_id on every forward with this KV cache or on none: the cached "
                "positions were given " + ("ids" if self.sequence_id is not None else "no ids")
            )
        if sequence_id is not None:
            if self.sequence_id is not None:
                sequence_id = torch.cat([self.sequence_id, sequence_id], dim=1)
            self.sequence_id = sequence_id
        self.length += new_len
        return self.sequence_id

    def queries(self, seq_len: int, device: torch.device) -> None:
        """None: a forward's tokens are the last of the cached positions (`Keys`)."""
        del seq_len, device
