"""The block a finished training run prints last: where its files are and the commands to try
next, with this run's real paths, so a newcomer at the end of `make demo` need not search the
README for what to do with what was just trained."""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from pathlib import Path

from llmfoundry.utils.secrets import redact_argv

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


def next_steps(
    run_dir: Path,
    run_name: str,
    save_folder: str | None,
    overrides: Sequence[str],
    cwd: Path | None = None,
    launcher: Sequence[str] = ("python",),
    tokenizer_found: bool = True,
) -> str:
    """The run folder and the commands that generate from, serve, resume and list this run.

    `overrides` are the command line's (Hydra's task overrides): the resume command repeats
    them with this run's name and autoresume=true, so it continues this run, not a new one;
    credentials in them are printed `<redacted>` (put them back, or better, in the environment).
    `launcher` starts the resume command (`torchrun --nproc_per_node=8` for a torchrun run:
    its strategy refuses to start without one). Without `tokenizer_found` (token files made
    elsewhere, trained without their tokenizer) generating and serving need one named.
    """
    cwd = cwd or Path(os.getcwd())
    folder = shown_path(run_dir, cwd)
    lines = [f"run folder: {folder} (train.log, metrics.jsonl; README: After pretraining)"]
    lines.append("next:")
    commands: list[tuple[str, str]] = []
    if save_folder:
        checkpoints = shlex.quote(redact_argv([shown_path(save_folder, cwd)])[0])
        named, whose = "", ""
        if not tokenizer_found:
            named = " --tokenizer TOKENIZER"
            whose = (
                "; TOKENIZER: the one your tokens came from (tiktoken:gpt2 for nanoGPT's, "
                "a tokenizer.json or .model)"
            )
        commands += [
            (
                f"python scripts/generate.py {checkpoints}{named} --prompt 'def '",
                f"sample from it{whose}",
            ),
            (
                f"python scripts/serve.py {checkpoints}{named}",
                "chat with it (OpenAI API, port 8000)",
            ),
        ]
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
