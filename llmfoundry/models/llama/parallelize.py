"""Llama's parallelization plan (see llmfoundry/models/plan.py)."""

from __future__ import annotations

from llmfoundry.models.llama.model import LlamaForCausalLM
from llmfoundry.models.plan import ParallelPlan


def parallelize_plan(model: LlamaForCausalLM) -> ParallelPlan:
    """Its blocks, as MPT's: one layer's weights gathered at a time; the embedding, the final
    norm and an untied lm_head stay with the root."""
    return ParallelPlan(blocks=list(model.transformer.blocks))
