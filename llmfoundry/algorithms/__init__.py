"""Algorithms: changes to training applied at named events (one file each)."""

from llmfoundry.algorithms.ema import EMA
from llmfoundry.algorithms.gradient_clipping import GradientClipping
from llmfoundry.algorithms.loss_spike_guard import LossSpikeGuard
from llmfoundry.algorithms.random_token_replacement import RandomTokenReplacement
from llmfoundry.algorithms.seq_length_warmup import SeqLengthWarmup

__all__ = [
    "EMA",
    "GradientClipping",
    "LossSpikeGuard",
    "RandomTokenReplacement",
    "SeqLengthWarmup",
]
