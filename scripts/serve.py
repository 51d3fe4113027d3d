"""Serve a trained model over HTTP with an OpenAI-compatible API (FastAPI + uvicorn).

    python scripts/serve.py outputs/run/checkpoints                  # 127.0.0.1:8000
    LLMFOUNDRY_API_KEY=secret python scripts/serve.py hf_out/ --host 0.0.0.0 --port 8080
    python scripts/serve.py hf_out/ --engine vllm                    # vLLM on a GPU instead

    curl localhost:8000/v1/completions -H 'content-type: application/json' \\
        -d '{"prompt": "def add(", "max_tokens": 32, "temperature": 0}'

The model's id in the API is --served-model-name, else the run_name of the run that trained the
checkpoint (what `runs.py` lists), else the folder's name (a transformers folder's, say).
Endpoints: POST /v1/completions, POST /v1/chat/completions (with a chat template: --chat-template
FILE, the default finetune format's for a checkpoint finetuned in it, or the tokenizer folder's),
GET /v1/models, GET /health, GET /metrics.
Concurrent requests decode together (continuous batching). With LLMFOUNDRY_API_KEY set every
route but /health needs `Authorization: Bearer <key>`; without it the server binds loopback only,
and a key that is set but empty is refused. SIGTERM (or Ctrl-C) stops accepting, finishes the
requests in flight (up to --drain-timeout seconds), then exits. A wrong path or option ends
with one line and status 2 (--debug: the traceback).
Needs the `serve` extra: pip install 'llmfoundry[serve]'.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from llmfoundry.checkpoint.pretrained import WEIGHT_DTYPES, is_hf_folder, read_pretrained
from llmfoundry.distributed.base import resolve_device
from llmfoundry.serving.auth import api_key_from_env
from llmfoundry.serving.vllm import API_KEY_ENV, require_vllm, vllm_command
from llmfoundry.utils.cli import add_script_arguments, script_errors
from llmfoundry.utils.errors import UserError

MAX_BODY_BYTES = 1 << 20
MAX_CONCURRENT = 32
LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]  # uvicorn's
# Our flags vLLM has under another name; the limits vLLM lacks are refused with --engine vllm.
VLLM_FLAGS = {
    "tokenizer": "--tokenizer",
    "chat_template": "--chat-template",
    "max_concurrent": "--max-num-seqs",
    "dtype": "--dtype",
}
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
NOT_FOR_VLLM = (
    "max_prompt_tokens",
    "max_tokens",
    "max_body_bytes",
    "max_batch_rows",
    "eos_token",
    "storage",  # vLLM reads object stores with its own client: AWS_ENDPOINT_URL, AWS_PROFILE
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "model",
        help="checkpoint, save folder, Composer checkpoint (*-rank0.pt or its sharded folder), or "
        "transformers MPT/Llama folder",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument(
        "--served-model-name",
        "--model-name",
        dest="served_model_name",
        help="the model's id in the API (default: the checkpoint's run name, else the folder's)",
    )
    p.add_argument("--engine", choices=["llmfoundry", "vllm"], default="llmfoundry")
    p.add_argument(
        "--tokenizer",
        help="tokenizer.json, tokenizer folder, .model, .tiktoken or tiktoken:NAME (default: found)",
    )
    p.add_argument("--eos-token", help="EOS token (default <|endoftext|> when it exists)")
    p.add_argument("--chat-template", type=Path, help="Jinja chat template for chat requests")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--dtype", choices=WEIGHT_DTYPES, help="weights' dtype (default fp32)")
    p.add_argument("--max-prompt-tokens", type=_positive, help="default: the model's context - 1")
    p.add_argument("--max-tokens", type=_positive, help="max_tokens limit (default: context - 1)")
    p.add_argument("--max-body-bytes", type=_positive, help=f"default {MAX_BODY_BYTES}")
    p.add_argument(
        "--max-concurrent",
        type=_positive,
        help=f"prompts in flight, 429 above (default {MAX_CONCURRENT})",
    )
    p.add_argument(
        "--max-batch-rows",
        type=_positive,
        help="prompts decoded together (default: --max-concurrent)",
    )
    p.add_argument("--drain-timeout", type=float, default=60.0, help="seconds to finish on SIGTERM")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    add_script_arguments(p)  # --storage: a model on s3://... (scripts/deploy.py renders it)
    return p.parse_args(argv)


def served_model_name(args: argparse.Namespace, run_name: str | None) -> str:
    """The model's id in the API: the flag, else the run that trained it (every checkpoint of a
    run sits in a folder named `checkpoints`, so the folder's name says nothing), else the
    folder's name."""
    return args.served_model_name or run_name or Path(args.model.rstrip("/")).name


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (0-65535)")
    return port


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def _given(value: int | None, default: int) -> int:
    """A flag's value, or its default when absent (0 is a value, which Limits refuses)."""
    return default if value is None else value


def vllm_args(args: argparse.Namespace, name: str) -> list[str]:
    """The `vllm serve` command for these arguments; flags vLLM cannot honour are refused."""
    unsupported = [f"--{k.replace('_', '-')}" for k in NOT_FOR_VLLM if getattr(args, k)]
    if unsupported:
        raise UserError(
            f"{', '.join(unsupported)} apply to --engine llmfoundry only; vLLM has its own "
            "limits (vllm serve --help)"
        )
    command = vllm_command(args.model, args.host, args.port, name)
    for key, flag in VLLM_FLAGS.items():
        value = getattr(args, key)
        if value is not None:
            command += [flag, VLLM_DTYPES.get(value, str(value)) if key == "dtype" else str(value)]
    return command


def serve_vllm(args: argparse.Namespace, name: str, api_key: str | None) -> None:
    """Replace this process with vLLM serving the transformers folder."""
    if not is_hf_folder(args.model):
        raise UserError(
            f"--engine vllm serves a transformers folder and {args.model} is not one; "
            "export the checkpoint first with scripts/export_hf.py"
        )
    command = vllm_args(args, name)
    try:
        require_vllm()
    except ImportError as err:
        raise UserError(str(err)) from None
    env = dict(os.environ)
    env.pop(API_KEY_ENV, None)  # vLLM gets our checked key (as VLLM_API_KEY) or none
    if api_key is not None:  # through the environment: the command line is visible to `ps`
        env[API_KEY_ENV] = api_key
    os.execvpe(command[0], command, env)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with script_errors(args):
        return serve(args)


def serve(args: argparse.Namespace) -> int:
    level = "DEBUG" if args.log_level == "trace" else args.log_level.upper()  # trace: uvicorn's
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    api_key = api_key_from_env(args.host, os.environ)  # before any work: auth fails closed
    if args.engine == "vllm":  # a transformers folder: it records no run
        serve_vllm(args, served_model_name(args, None), api_key)
    try:
        import uvicorn

        from llmfoundry.serving.app import Limits, create_app
    except ImportError as err:
        raise UserError(
            f"serving needs FastAPI and uvicorn ({err}): pip install 'llmfoundry[serve]'"
        ) from None
    from llmfoundry.serving.engine import Engine
    from llmfoundry.serving.tokenizer import load_served_tokenizer

    device = resolve_device(args.device, "--device")
    loaded = read_pretrained(args.model)
    model, name = loaded.model, served_model_name(args, loaded.run_name)
    tokenizer_path = args.tokenizer or loaded.tokenizer
    if tokenizer_path is None:
        raise UserError(
            f"no tokenizer found with {args.model}; pass --tokenizer PATH/tokenizer.json"
        )
    trained = loaded.chat_template if args.chat_template is None else None  # reads its data
    tokenizer = load_served_tokenizer(tokenizer_path, args.eos_token, args.chat_template, trained)
    model.to(device=device, dtype=WEIGHT_DTYPES[args.dtype or "fp32"])
    context = model.config.max_seq_len
    limits = Limits(
        max_prompt_tokens=_given(args.max_prompt_tokens, context - 1),
        max_tokens=_given(args.max_tokens, context - 1),
        max_body_bytes=_given(args.max_body_bytes, MAX_BODY_BYTES),
        max_concurrent=_given(args.max_concurrent, MAX_CONCURRENT),
    )
    # A batch keeps admitting newcomers while its cache stays within two contexts.
    rows = _given(args.max_batch_rows, limits.max_concurrent)
    engine = Engine(model, tokenizer.decode, max_rows=rows, max_len=2 * context)
    app = create_app(engine, tokenizer, name, limits, context, api_key)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.drain_timeout,
    )
    uvicorn.Server(config).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
