"""model.compile=true: every block compiled with torch.compile; losses and gradients unchanged."""

import pytest
import torch

from llmfoundry.distributed import SingleDevice
from llmfoundry.models import MPTConfig, MPTForCausalLM


@pytest.mark.slow  # torch.compile on CPU (~30-60 s)
def test_compiled_and_eager_losses_agree():
    """At two lengths, then with documents. The blocks compile once, once more for a second
    length (dynamic shapes) and once for documents: the ALiBi/document bias is built before
    the blocks run (`AttentionMasks.forward`), not traced into them and looked up by length
    (which compiled them 8 times for the first length and twice per length after)."""
    base = dict(d_model=32, n_heads=4, n_layers=2, max_seq_len=16, vocab_size=64, kv_n_heads=2)
    torch.manual_seed(0)
    eager = MPTForCausalLM(MPTConfig(**base))
    compiled = SingleDevice("cpu").prepare(MPTForCausalLM(MPTConfig(**base, compile=True)))
    compiled.load_state_dict(eager.state_dict())  # same names: compiling keeps the state dict
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    graphs = []
    for seq_len, documents in ((16, False), (12, False), (12, True)):
        ids = torch.randint(0, 64, (2, seq_len))
        sid = (torch.arange(seq_len) >= 5).long().expand(2, -1) if documents else None
        losses = []
        for model in (eager, compiled):
            model.zero_grad(set_to_none=True)
            loss = MPTForCausalLM.loss(model(ids, sid), ids)
            loss.backward()
            losses.append(loss)
        torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-5)
        for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-5, msg=name)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert all(block._compiled_call_impl is not None for block in compiled.transformer.blocks)
    assert graphs == [1, 2, 3]
