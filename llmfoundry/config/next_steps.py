"""The block a finished training run prints last: where its files are and the commands to try
next, with this run's real paths, so a newcomer at the end of `make demo` need not search the
README for what to do with what was just trained."""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from llmfoundry.utils.secrets import redact_argv, redact_secrets

# Overrides the resume command sets itself.
_RESUME_KEYS = ("run_name", "autoresume")


def launcher_of(env: dict[str, str]) -> list[str]:
    """The command that started this process's training script, as far as torchrun's variables
    say (per node: a multi-node run repeats it on each node, as it was launched), through the
    README's torchrun launcher."""
    if int(env.get("WORLD_SIZE", "1")) <= 1:
        return ["python"]
    nproc = f"--nproc_per_node={env.get('LOCAL_WORLD_SIZE', '1')}"
    launcher = ["python", "scripts/torchrun.py", nproc]
    nodes = int(env["WORLD_SIZE"]) // max(1, int(env.get("LOCAL_WORLD_SIZE", "1")))
    return launcher + ([f"--nnodes={nodes}", "..."] if nodes > 1 else [])


def shown_path(path: str | Path, cwd: Path) -> str:
    """`path` as a user types it from `cwd`: relative when under it, else as given (URLs too)."""
    text = str(path)
    if "://" in text:
        return text
    resolved = (cwd / path).resolve()  # a relative path is relative to cwd
    try:
        return str(resolved.relative_to(cwd.resolve()))
    except ValueError:
        return str(resolved)


def storage_flag(storage: Mapping[str, Any] | None) -> str:
    """` --storage '<block>'` for the scripts that read a checkpoint from an object store, with
    the run's `storage:` settings that are set (an endpoint, a profile), so the printed command
    reaches the store the run saved to; "" when none is set. Secret-named keys are left out:
    credentials come from the environment."""

    def set_values(value: Any) -> Any:
        if isinstance(value, Mapping):
            kept = {k: set_values(v) for k, v in value.items()}
            return {k: v for k, v in kept.items() if v not in (None, {})}
        return value

    block = set_values(redact_secrets(dict(storage or {})))
    return f" --storage {shlex.quote(json.dumps(block))}" if block else ""


def _generate_and_serve(
    checkpoints: str, tokenizer_found: bool, storage: Mapping[str, Any] | None
) -> list[tuple[str, str]]:
    """The commands that sample from and serve the checkpoints, each with why."""
    where = shlex.quote(redact_argv([checkpoints])[0])
    if "://" in checkpoints:
        where += storage_flag(storage)
    named, whose = "", ""
    if not tokenizer_found:
        named = " --tokenizer TOKENIZER"
        whose = (
            "; TOKENIZER: the one your tokens came from (tiktoken:gpt2 for nanoGPT's, "
            "a tokenizer.json or .model)"
        )
    return [
        (f"python scripts/generate.py {where}{named} --prompt 'def '", f"sample from it{whose}"),
        (f"python scripts/serve.py {where}{named}", "chat with it (OpenAI API, port 8000)"),
    ]


def next_steps(
    run_dir: Path,
    run_name: str,
    save_folder: str | None,
    overrides: Sequence[str],
    cwd: Path | None = None,
    launcher: Sequence[str] = ("python",),
    tokenizer_found: bool = True,
    own_module: bool = False,
    storage: Mapping[str, Any] | None = None,
) -> str:
    """The run folder and the commands that generate from, serve, resume and list this run.

    `overrides` are the command line's (Hydra's task overrides): the resume command repeats
    them with this run's name and autoresume=true, so it continues this run, not a new one;
    credentials in them are printed `<redacted>` (put them back, or better, in the environment).
    `launcher` starts the resume command (`torchrun --nproc_per_node=8` for a torchrun run:
    its strategy refuses to start without one). Without `tokenizer_found` (token files made
    elsewhere, trained without their tokenizer) generating and serving need one named. An
    `own_module` (model=custom) checkpoint is refused by generate.py and serve.py, so they are
    not offered. `storage` is the run's `storage:` block: a checkpoint on an object store is
    read with its settings.
    """
    cwd = cwd or Path(os.getcwd())
    folder = shown_path(run_dir, cwd)
    lines = [f"run folder: {folder} (train.log, metrics.jsonl; README: After pretraining)"]
    lines.append("next:")
    commands: list[tuple[str, str]] = []
    if save_folder:
        if own_module:
            lines.append(
                "  (your own module: scripts/generate.py and serve.py build only the model "
                "families; load a checkpoint's model.safetensors into your module in Python)"
            )
        else:
            commands += _generate_and_serve(shown_path(save_folder, cwd), tokenizer_found, storage)
        kept = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] not in _RESUME_KEYS]
        kept = redact_argv(kept)
        resume = shlex.join(
            [*launcher, "scripts/train.py", *kept, f"run_name={run_name}", "autoresume=true"]
        )
        commands.append((resume, "continue it (raise max_duration to train longer)"))
    else:
        lines.append("  (no checkpoints: save_folder=null, so nothing to generate from or resume)")
    if run_name.startswith("demo"):
        commands.append(("make finetune-demo", "instruction-finetune this model"))
    runs_root = shown_path(run_dir.parent, cwd)
    runs = "python scripts/runs.py" + ("" if runs_root == "outputs" else f" {runs_root}")
    commands.append((runs, "this run beside the others"))
    lines += [f"  {command}  # {why}" for command, why in commands]
    return "\n".join(lines)
