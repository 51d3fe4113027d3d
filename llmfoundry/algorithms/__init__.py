"""Algorithms: changes to training applied at named events (one file each)."""

from llmfoundry.algorithms.gradient_clipping import GradientClipping
from llmfoundry.algorithms.random_token_replacement import RandomTokenReplacement

__all__ = ["GradientClipping", "RandomTokenReplacement"]
