"""Serving a trained model over HTTP (`scripts/serve.py`), and its Kubernetes deployment.

`engine` batches concurrent requests through one continuous-batching decoder; `app` is the
OpenAI-compatible FastAPI server over it (the `serve` extra); `vllm` builds the command that
serves an exported transformers folder with vLLM instead; `deploy` renders a Deployment and a
Service for either.
"""
