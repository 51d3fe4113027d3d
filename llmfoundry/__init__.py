"""llmfoundry: LLM pretraining recipes (MPT models, MDS streaming data, an event-driven trainer)."""

__version__ = "0.1.0"
