"""Serving with vLLM instead of our engine: the command, for a GPU machine or a pod.

vLLM serves transformers folders, so the model is the folder `scripts/export_hf.py` wrote. The
API key goes through the environment (`VLLM_API_KEY`), never the command line, where `ps` and
the pod spec would show it.
"""

from __future__ import annotations

import importlib.util

from llmfoundry.utils.errors import MissingPackage

__all__ = ["API_KEY_ENV", "require_vllm", "vllm_command"]

API_KEY_ENV = "VLLM_API_KEY"


def vllm_command(model: str, host: str, port: int, model_name: str) -> list[str]:
    """`vllm serve` of the transformers folder `model`, OpenAI API on host:port."""
    return [
        "vllm",
        "serve",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--served-model-name",
        model_name,
    ]


def require_vllm() -> None:
    """Refuse, saying how to fix it, when vLLM is not installed here."""
    if importlib.util.find_spec("vllm") is None:
        raise MissingPackage(
            "--engine vllm needs vLLM, which is not installed: pip install 'llmfoundry[vllm]' "
            "(on a machine with a CUDA GPU), or serve with the default --engine llmfoundry"
        )
