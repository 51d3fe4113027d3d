"""Score a checkpoint or a transformers (MPT or Llama) folder on in-context-learning tasks (.jsonl files, or llm-foundry icl_tasks YAMLs).

    python scripts/eval.py outputs/my-run/checkpoints tasks/*.jsonl --shots 3 --out eval.json
    python scripts/eval.py outputs/my-run/checkpoints tasks_v0.3.yaml --out eval.json

Each .jsonl file is one task, named after the file; its kind (multiple choice, LAMBADA-style
language modelling, exact-match QA) follows from its fields (llmfoundry/eval/icl.py). A .yaml
or .yml file is an llm-foundry icl_tasks YAML: one task per entry and num_fewshot, named
<label>/<n>-shot and scored as llm-foundry scores it (llmfoundry/eval/foundry_tasks.py; its
relative dataset_uri paths are read from the current directory). Prints a table of per-task
accuracy, the Eval Gauntlet's categories and averages (--gauntlet) and CORE (--core), each with
a bootstrap 95% interval (llmfoundry/eval/composite.py), and writes them with the settings to
--out as JSON.

Under torchrun the model is split over the processes as training splits it, with the same
results as one process: --pp stages, --tp tensor-parallel ranks, --cp context-parallel ranks
(each sequence split over them: long contexts), FSDP over the rest; a sharded checkpoint is
read shard by shard, never whole on one process (llmfoundry/checkpoint/on_mesh.py):

    torchrun --nproc-per-node 4 scripts/eval.py outputs/my-run/checkpoints tasks/*.jsonl --tp 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from llmfoundry.checkpoint.on_mesh import load_on_mesh
from llmfoundry.checkpoint.pretrained import load_pretrained
from llmfoundry.eval import evaluate_tasks, load_tasks
from llmfoundry.eval.composite import Composites, report_json, report_table
from llmfoundry.eval.forward import mesh_forward
from llmfoundry.eval.icl import BATCH_SIZE
from llmfoundry.eval.scoring import Forward
from llmfoundry.tokenizers.tokenizer import prepare_tokenizer
from llmfoundry.utils.cli import add_script_arguments, script_errors
from llmfoundry.utils.errors import UserError
from llmfoundry.utils.files import atomic_write
from llmfoundry.utils.logs import configure_logging


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "model",
        help="checkpoint, save folder (its latest), Composer checkpoint (*-rank0.pt or its sharded "
        "folder) or transformers MPT/Llama folder",
    )
    p.add_argument(
        "tasks", nargs="+", help=".jsonl task files or icl_tasks .yaml files (paths or URLs)"
    )
    p.add_argument(
        "--shots", type=int, default=0, help="examples before each .jsonl query (default 0)"
    )
    p.add_argument("--seed", type=int, default=17, help="seed of the shot choice (default 17)")
    p.add_argument("--limit", type=int, help="score only the first N examples of each task")
    p.add_argument(
        "--batch-size",
        type=int,
        default=BATCH_SIZE,
        help=f"rows per forward (default {BATCH_SIZE})",
    )
    p.add_argument(
        "--tokenizer",
        help="tokenizer.json, folder, .model, .tiktoken or tiktoken:NAME (default: the model's)",
    )
    p.add_argument("--gauntlet", help="llm-foundry eval_gauntlet YAML: print its composites")
    p.add_argument("--core", help="YAML of the same shape: print CORE over its benchmarks")
    p.add_argument(
        "--bootstrap",
        type=int,
        default=1000,
        help="resamples of the 95%% intervals (default 1000; 0: none)",
    )
    p.add_argument("--bootstrap-seed", type=int, default=0, help="its seed (default 0)")
    p.add_argument("--out", help="write the results as JSON here")
    mesh = p.add_argument_group("under torchrun (the model split over its processes)")
    mesh.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    mesh.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    mesh.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel ranks: each sequence split over them (default 1)",
    )
    add_script_arguments(p)
    args = p.parse_args(argv)
    configure_logging()
    with script_errors(args):
        return run(args)


def run(args: argparse.Namespace) -> int:
    composites = Composites.read(args.gauntlet, args.core, args.bootstrap, args.bootstrap_seed)
    if "RANK" in os.environ:  # torchrun's: every process scores, rank 0 reports
        loaded = load_on_mesh(args.model, tp=args.tp, pp=args.pp, cp=args.cp)
        try:
            forward = mesh_forward(loaded.model, loaded.strategy)
            results = score(args, composites, loaded.model, loaded.tokenizer, forward)
        finally:
            loaded.strategy.teardown()
        if loaded.strategy.rank != 0:
            return 0
    else:
        if (args.tp, args.pp, args.cp) != (1, 1, 1):
            raise UserError(
                f"--tp {args.tp} --pp {args.pp} --cp {args.cp} split the model over torchrun's "
                "processes: launch with `torchrun --nproc-per-node N scripts/eval.py ...`"
            )
        model, tokenizer_path = load_pretrained(args.model)
        results = score(args, composites, model, tokenizer_path)
    report = composites.report(results)
    print(report_table(results, report))
    if args.out:
        settings = {"model": args.model, "shots": args.shots, "seed": args.seed}
        atomic_write(args.out, json.dumps(settings | report_json(results, report), indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


def score(
    args: argparse.Namespace,
    composites: Composites,
    model: torch.nn.Module,
    tokenizer_path: str | None,
    forward: Forward | None = None,
) -> dict[str, dict]:
    """Each task's results (`evaluate_tasks`), the model run through `forward` (None: whole
    on this process); the tasks are checked against `composites` first."""
    tokenizer_path = args.tokenizer or tokenizer_path
    if tokenizer_path is None:
        raise UserError(f"{args.model} has no tokenizer; pass --tokenizer tokenizer.json")
    tokenizer = prepare_tokenizer(tokenizer_path, require_eos=False)
    tasks = load_tasks(args.tasks)
    composites.check({task.benchmark(args.shots) for task in tasks})
    return evaluate_tasks(
        model,
        tokenizer,
        tasks,
        args.shots,
        args.seed,
        args.limit,
        forward=forward,
        batch_size=args.batch_size,
    )


if __name__ == "__main__":
    sys.exit(main())
