"""Context parallelism's layout and math in one process (llmfoundry/distributed/context.py):
which positions a rank holds, its targets, and that each rank's forward, its keys gathered,
gives one process's logits at its positions, for every family, position scheme, mask and
kernel. The gather is simulated: it returns the one-process forward's keys and values, each
rank's part where that rank's gather would put it, and checks that the rank projected its own
part alike (so positions and rotations are the global ones). The real collective, gradients
and training are tests/distributed/test_context_parallel.py's.
"""

import pytest
import torch

from llmfoundry.core.loss import next_token_loss, next_token_loss_sum
from llmfoundry.core.metrics import LanguageMetrics, loss_token_count
from llmfoundry.distributed import context as context_module
from llmfoundry.distributed.context import (
    ContextParallel,
    check_context_parallel,
    load_balanced_index,
)
from llmfoundry.models import parallel_plan
from llmfoundry.models.generation import new_cache
from llmfoundry.models.layers import flash
from llmfoundry.models.layers.kv_cache import KVCache
from llmfoundry.models.llama import LlamaConfig, LlamaForCausalLM
from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM
from llmfoundry.utils.errors import UserError
from tests.models.test_mpt_kernels import flash_on_cpu  # noqa: F401 (a fixture)

SEQ_LEN, VOCAB = 16, 64
# Two rows of packed documents whose boundaries fall inside chunks at cp=2 and cp=4.
SEQUENCE_ID = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 3 + [1] * 13])


def test_each_rank_holds_an_early_and_a_late_chunk():
    assert load_balanced_index(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert load_balanced_index(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert load_balanced_index(16, 4, 1).tolist() == [2, 3, 12, 13]
    for cp in (2, 4):
        held = torch.cat([load_balanced_index(32, cp, r) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(32))
        keys = ContextParallel(cp, 0, None).keys(None, 32 // cp, n_layers=1)
        assert torch.equal(held[keys.order(held.device)], torch.arange(32))


def test_shard_splits_ids_and_targets_shifted_over_the_whole_sequence():
    ids = torch.arange(2 * SEQ_LEN).view(2, SEQ_LEN)
    labels = ids.clone()
    labels[0, 4] = -100
    batch = {"input_ids": ids, "labels": labels, "sequence_id": SEQUENCE_ID}
    local = ContextParallel(2, 0, None).shard(batch)
    assert set(local) == {"input_ids", "targets", "sequence_id"}
    assert local["input_ids"][0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    # Position 3's target is position 4's label, which rank 1 holds; the last has none.
    assert local["targets"][0].tolist() == [1, 2, 3, -100, 13, 14, 15, -100]
    assert local["sequence_id"] is SEQUENCE_ID  # whole: every key's document
    # The ranks' losses and counts sum to the whole sequence's.
    logits = torch.randn(2, SEQ_LEN, VOCAB)
    parts = [ContextParallel(4, r, None) for r in range(4)]
    shards = [(part.shard(batch), part.index(SEQ_LEN)) for part in parts]
    total = sum(next_token_loss_sum(logits[:, index], shard) for shard, index in shards)
    count = sum(loss_token_count(shard) for shard, _ in shards)
    assert count == loss_token_count(labels)
    torch.testing.assert_close(total / count, next_token_loss(logits, labels))
    # So do the eval metrics' totals (row 1 masked out as a repeated sample).
    sample_mask = torch.tensor([True, False])
    whole, parts_sum = LanguageMetrics(logits.device), LanguageMetrics(logits.device)
    whole.update(logits, batch, sample_mask)
    for shard, index in shards:
        parts_sum.update(logits[:, index], shard, sample_mask)
    torch.testing.assert_close(parts_sum.totals, whole.totals)


def test_shard_refuses_what_it_cannot_split():
    context = ContextParallel(2, 1, None)
    ids = torch.zeros(2, 14, dtype=torch.long)
    with pytest.raises(UserError, match=r"^parallelism.cp=2 splits each sequence into 4 chunks"):
        context.shard({"input_ids": ids, "labels": ids})
    ids = torch.zeros(2, 16, dtype=torch.long)
    with pytest.raises(UserError, match=r"but the batch also has attention_mask; drop them"):
        context.shard({"input_ids": ids, "labels": ids, "attention_mask": ids})


def _mpt(**overrides):
    """4 query and 2 key/value heads, ALiBi, a sliding window of 6 (it cuts into documents)."""
    config = MPTConfig(
        d_model=32, n_heads=4, kv_n_heads=2, n_layers=2, vocab_size=VOCAB, max_seq_len=SEQ_LEN,
        sliding_window=6, **overrides,
    )  # fmt: skip
    return MPTForCausalLM(config)


def _llama(**overrides):
    config = LlamaConfig(
        d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=VOCAB, max_seq_len=SEQ_LEN,
        **overrides,
    )  # fmt: skip
    return LlamaForCausalLM(config)


MODELS = {
    "mpt_alibi_window": _mpt,
    "mpt_learned_positions": lambda **o: _mpt(alibi=False, learned_pos_emb=True, **o),
    "mpt_rope": lambda **o: _mpt(alibi=False, rope=True, **o),
    "llama": _llama,
}


def _simulated_gather(cache: KVCache, cp: int, rank: int):
    """all_gather_autograd as the cp group would run it in each layer (in order): the
    ranks' parts of the one-process forward's keys and values, after this rank's own, which
    must equal them."""
    layers = iter(cache.layers)

    def gather(both, gather_dim, group):
        layer = next(layers)
        whole = torch.cat([layer.k, layer.v], dim=1).movedim(2, 0)[: cache.length]
        parts = [whole[load_balanced_index(cache.length, cp, r)] for r in range(cp)]
        torch.testing.assert_close(both, parts[rank], rtol=0, atol=1e-5)
        return torch.cat(parts)

    return gather


def _each_rank_logits(model, ids, sequence_id, cache, monkeypatch, cp):
    """The logits of each of `cp` ranks' forwards at its positions, put back in order (its
    keys gathered by `_simulated_gather` from `cache`, a one-process forward's)."""
    logits = []
    for rank in range(cp):
        context = ContextParallel(cp, rank, None)
        gather = _simulated_gather(cache, cp, rank)
        monkeypatch.setattr(context_module, "all_gather_autograd", gather)
        keys = context.keys(sequence_id, SEQ_LEN // cp, model.config.n_layers)
        logits.append(model(ids[:, context.index(SEQ_LEN)], cache=keys))
    order = torch.argsort(torch.cat([load_balanced_index(SEQ_LEN, cp, r) for r in range(cp)]))
    return torch.cat(logits, dim=1)[:, order]


def _one_process(model, ids, sequence_id):
    """The one-process logits, and its keys and values in a cache."""
    cache = new_cache(model, SEQ_LEN)
    whole = model(ids, sequence_id)
    torch.testing.assert_close(model(ids, sequence_id, cache=cache), whole)
    return whole, cache


@pytest.mark.usefixtures("flash_on_cpu")
@pytest.mark.parametrize("documents", [True, False], ids=["documents", "one_document"])
@pytest.mark.parametrize("attn_impl", ["torch", "sdpa", "flash"])
@pytest.mark.parametrize("name", MODELS)
def test_each_rank_gives_one_process_logits_at_its_positions(
    monkeypatch, name, attn_impl, documents
):
    """flash: its glue (a run of queries at a time, over the keys up to its end) with the
    kernel's semantics written out (tests/models/test_mpt_kernels.py)."""
    monkeypatch.setattr(flash, "missing_package", lambda: None)
    torch.manual_seed(0)
    model = MODELS[name](attn_impl=attn_impl)
    ids = torch.randint(0, VOCAB, (2, SEQ_LEN))
    sequence_id = SEQUENCE_ID if documents else None
    whole, cache = _one_process(model, ids, sequence_id)
    for cp in (2, 4):
        got = _each_rank_logits(model, ids, sequence_id, cache, monkeypatch, cp)
        torch.testing.assert_close(got, whole, rtol=0, atol=1e-5)


@torch.no_grad()  # flex runs forward only on CPU
def test_flex_ranks_give_the_torch_kernels_one_process_logits(monkeypatch):
    """flex's block mask and ALiBi score_mod read each rank's query positions: every rank's
    logits equal one process's with the `torch` kernel (documents, a window, grouped heads)."""
    torch.manual_seed(0)
    reference = _mpt(attn_impl="torch")
    torch.manual_seed(0)
    model = _mpt(attn_impl="flex")
    ids = torch.randint(0, VOCAB, (2, SEQ_LEN))
    whole, cache = _one_process(reference, ids, SEQUENCE_ID)
    for cp in (2, 4):
        got = _each_rank_logits(model, ids, SEQUENCE_ID, cache, monkeypatch, cp)
        torch.testing.assert_close(got, whole, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["mpt_alibi_window", "llama"])
def test_a_pipeline_stage_takes_positions_and_mask_from_the_keys(monkeypatch, name):
    """The families' stage forward (one stage holding every block) with a rank's keys gives its
    positions' logits, as the model's forward does."""
    torch.manual_seed(0)
    model = MODELS[name](attn_impl="torch")
    ids = torch.randint(0, VOCAB, (2, SEQ_LEN))
    whole, cache = _one_process(model, ids, SEQUENCE_ID)
    stage_forward = parallel_plan(model).pipeline.forward
    context = ContextParallel(2, 0, None)
    monkeypatch.setattr(context_module, "all_gather_autograd", _simulated_gather(cache, 2, 0))
    index, keys = context.index(SEQ_LEN), context.keys(SEQUENCE_ID, SEQ_LEN // 2, 2)
    got = stage_forward(
        model, ids[:, index], seq_len=SEQ_LEN // 2, first=True, last=True, keys=keys
    )
    torch.testing.assert_close(got, whole[:, index], rtol=0, atol=1e-5)


def test_infini_attention_refuses_context_parallelism():
    check_context_parallel(parallel_plan(_mpt()), 2)
    infini = MPTForCausalLM(MPTConfig(d_model=32, n_heads=4, n_layers=1, infini={"segment_len": 8}))
    with pytest.raises(UserError, match=r"^parallelism.cp=2: model.infini's memory runs through"):
        check_context_parallel(parallel_plan(infini), 2)


def test_a_rank_builds_the_bias_rows_of_its_queries_only(monkeypatch):
    """The dense kernels' bias for a rank's queries: [.., L / cp, L], never the L x L cache."""
    model = _mpt(attn_impl="torch").eval()
    cache = new_cache(model, SEQ_LEN)
    ids = torch.randint(0, VOCAB, (2, SEQ_LEN))
    with torch.no_grad():
        model(ids, cache=cache)
        model.transformer.masks.reset()
        context = ContextParallel(2, 1, None)
        monkeypatch.setattr(context_module, "all_gather_autograd", _simulated_gather(cache, 2, 1))
        model(ids[:, context.index(SEQ_LEN)], cache=context.keys(None, SEQ_LEN // 2, 2))
    assert model.transformer.masks.cached is None
