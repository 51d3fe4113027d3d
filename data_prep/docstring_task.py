"""A multiple-choice evaluation task from Python sources: which docstring goes with a signature?

Each documented function under FOLDERS gives one line {"query", "choices", "gold"} for
scripts/eval.py: the query is its signature formatted as the finetuning prompt (the tokenizer's
chat template or the default format of llmfoundry/data/prep/instructions.py), the choices its
docstring's first paragraph and others drawn with --seed. `make finetune-demo` builds one from
the standard library's test folders, which the demo's pretraining and finetuning data leave out.

  python data_prep/docstring_task.py /usr/lib/python3.12/test --tokenizer data/demo/mds/tokenizer.json \\
      --out data/demo/tasks/docstrings.jsonl --limit 200
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from llmfoundry.data.prep.docstrings import choice_task, docstring_examples
from llmfoundry.data.prep.instructions import Formatter
from llmfoundry.data.prep.interrupt import prep_script
from llmfoundry.utils.cli import add_script_arguments
from llmfoundry.utils.files import atomic_write
from llmfoundry.utils.logs import configure_logging


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("folders", nargs="+", help="folders of .py files")
    p.add_argument("--tokenizer", required=True, help="the finetuned model's tokenizer")
    p.add_argument("--out", required=True, help="the task's .jsonl file")
    p.add_argument("--choices", type=int, default=4, help="choices per question (default 4)")
    p.add_argument("--limit", type=int, default=200, help="questions at most (default 200)")
    p.add_argument("--seed", type=int, default=17, help="seed of the sample and the choices")
    add_script_arguments(p)
    args = p.parse_args(argv)
    configure_logging()
    with prep_script(args):
        formatter = Formatter(args.tokenizer)
        examples = []
        for folder in args.folders:
            for path in sorted(Path(folder).rglob("*.py")):
                try:
                    examples += docstring_examples(path.read_text(encoding="utf-8"))
                except (OSError, UnicodeDecodeError):
                    continue
        if len(examples) > args.limit:
            examples = random.Random(args.seed).sample(examples, args.limit)
        for ex in examples:
            messages = [
                {"role": "user", "content": ex["prompt"]},
                {"role": "assistant", "content": ex["response"]},
            ]
            ex["prompt"] = formatter.prompt(messages)
        lines = choice_task(examples, args.choices, args.seed)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write(args.out, "".join(json.dumps(line) + "\n" for line in lines))
    print(f"{args.out}: {len(lines)} questions of {args.choices} choices")
    return 0


if __name__ == "__main__":
    sys.exit(main())
