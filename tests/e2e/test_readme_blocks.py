"""Every shell and Python block of README.md is exercised, so a block that goes stale fails here.

`CLAIMS` names, for each block, what exercises it; `test_every_block_is_claimed` fails for a
block nothing claims (a new one, or one whose first line changed). Most commands cannot run for
real here (a GPU, a cluster, 12 minutes of demo training, AWS), so every command of every shell
block is *validated* in one process: a script's arguments go through its own argparse parser (and
stop there), training overrides through the config check `scripts/train.py` runs first, torchrun's
through torchrun's parser, make targets and pip extras against the Makefile and the installed
package's metadata. The blocks a newcomer pastes first also run for real (marked slow), as bash
scripts with the placeholders filled in: "From zero to S3" steps 1 and 2 on moto with tiny
training, then `runs.py`; "Your own model"'s two files; the serving block
(tests/serving/test_readme_block.py) and the custom callback (test_readme_custom_code.py).
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import functools
import importlib.metadata
import io
import itertools
import os
import re
import runpy
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from llmfoundry.config.preflight import check
from llmfoundry.config.schema import ConfigError

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CONF = ROOT / "conf"


@dataclass
class Block:
    lang: str
    text: str
    line: int  # 1-based line of the opening fence

    @property
    def head(self) -> str:
        return self.text.lstrip().splitlines()[0] if self.text.strip() else ""


def readme_blocks() -> list[Block]:
    text = README.read_text(encoding="utf-8")
    return [
        Block(m["lang"], m["body"], text.count("\n", 0, m.start()) + 1)
        for m in re.finditer(r"^```(?P<lang>\w*)\n(?P<body>.*?)^```$", text, re.S | re.M)
    ]


# The first line of each shell / Python block, and what exercises it.
VALIDATED = "test_every_shell_command_is_valid"
RUN_AND_VALIDATED = VALIDATED + ", test_zero_to_s3_steps_run_with_tiny_training"
CLAIMS = {
    "make demo": VALIDATED,
    "python data_prep/text_to_tokens.py my_corpus/": RUN_AND_VALIDATED,
    "export AWS_ACCESS_KEY_ID=": RUN_AND_VALIDATED,
    "python scripts/torchrun.py --nproc_per_node=2 scripts/train.py": VALIDATED,
    "# one node, 8 GPUs": VALIDATED,
    "python scripts/train.py run_name=my-run autoresume=true": VALIDATED,
    "python scripts/generate.py outputs/my-run/checkpoints": VALIDATED,
    "make finetune-demo": VALIDATED,
    "python data_prep/instructions_to_mds.py chats.jsonl": VALIDATED,
    "pip install -e '.[serve]'": "tests/serving/test_readme_block.py",
    "python scripts/launch.py submit local conf/job/tiny.yaml": VALIDATED,
    "python scripts/launch.py render slurm run.yaml": VALIDATED + ", tests/launch/test_mcli.py",
    "make image": VALIDATED + ", tests/launch/test_dockerfile.py",
    "python scripts/runs.py": RUN_AND_VALIDATED,
    "python scripts/train.py -m optimizer.lr=1e-3,3e-3": VALIDATED,
    "python scripts/train.py data=memmap": VALIDATED,
    "python scripts/train.py mpt-small-cpu.yaml": "tests/config/test_foundry.py",
    "python scripts/eval.py outputs/my-run/checkpoints tasks_v0.3.yaml": VALIDATED
    + ", tests/eval/test_foundry_tasks.py",
    "python data_prep/adopt_tokens.py": VALIDATED + ", tests/data/test_adopt_tokens.py",
    "python scripts/plan.py model=llama3-70b": VALIDATED + ", tests/planning/test_mesh_planning.py",
    "python scripts/plan.py model=qwen3-30b-a3b": VALIDATED
    + ", tests/planning/test_moe_planning.py",
    "class RandomTokenReplacement(Algorithm):": "test_algorithm_excerpt_is_the_shipped_code",
    "# my_callbacks.py": "tests/e2e/test_readme_custom_code.py",
    "python scripts/train.py +callbacks.tokens._target_=": "tests/e2e/test_readme_custom_code.py",
    "# my_model.py": "test_own_model_blocks_train_and_write_a_run_folder",
    "python scripts/train.py model=custom": "test_own_model_commands_are_valid",
    "# train_my_model.py": "test_own_model_blocks_train_and_write_a_run_folder",
    "python scripts/import_hf.py mpt-hf": VALIDATED + ", tests/models/test_mpt_foundry_folders.py",
    "python scripts/generate.py tests/fixtures/foundry/alibi/ep0-ba4-rank0.pt": VALIDATED
    + ", tests/checkpoint/test_composer.py",
    "python scripts/eval.py outputs/my-run/checkpoints pick2.jsonl": VALIDATED
    + ", tests/eval/test_composite.py",
    "python -m llmfoundry.harness --model llmfoundry": "tests/eval/test_harness.py",
}


def claimed(block: Block) -> str | None:
    return next((test for head, test in CLAIMS.items() if block.head.startswith(head)), None)


def test_every_block_is_claimed():
    blocks = [b for b in readme_blocks() if b.lang in ("bash", "python")]
    unclaimed = [f"README.md:{b.line}: {b.head}" for b in blocks if claimed(b) is None]
    assert not unclaimed, "blocks no test exercises (add them to CLAIMS):\n" + "\n".join(unclaimed)
    heads = [claimed(b) and next(h for h in CLAIMS if b.head.startswith(h)) for b in blocks]
    assert sorted(set(heads)) == sorted(CLAIMS), "CLAIMS names blocks the README no longer has"


# ---------------------------------------------------------------------------------------------
# Validation of every command of every shell block.

# Placeholders of the README's commands, as a user fills them in.
PLACEHOLDERS = {"<time>": "20260101-000000", "HOST": "node-0"}
# Lines of shell blocks that show output rather than commands (the runs table).
OUTPUT_LINES = re.compile(r"^(NAME\s+STATUS|mpt-tiny-demo\s+running)")


def commands(block: Block) -> list[list[str]]:
    """The block's commands as argument lists (continuations joined, comments dropped)."""
    text = block.text.replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        if not line.strip() or OUTPUT_LINES.match(line):
            continue
        for before, after in PLACEHOLDERS.items():
            line = line.replace(before, after)
        line = re.sub(r"\[(--[\w-]+ \w+)\]", r"\1", line)  # an optional flag: [--dtype bf16]
        words = shlex.split(line, comments=True)
        for part in _split_on(words, {"&&", ";", "&", "|", ">"}):
            if part:
                found.append(part)
    return found


def _split_on(words: list[str], separators: set[str]) -> list[list[str]]:
    parts, current = [], []
    for word in words:
        if word in separators:
            parts.append(current)
            current = [] if word != ">" else ["<redirect>"]
        else:
            current.append(word)
    parts.append(current)
    return [p for p in parts if p and p[0] != "<redirect>"]


class _Parsed(Exception):
    """Raised when a script's own parser accepted its arguments: nothing after runs."""


@contextlib.contextmanager
def stop_after_parsing():
    """argparse's outermost parse (parse_args, or a script's own parse_known_args) raises
    _Parsed once it succeeded; the parses it makes inside (subparsers) return as usual."""
    depth = [0]
    originals = {n: getattr(argparse.ArgumentParser, n) for n in ("parse_args", "parse_known_args")}

    def wrap(original):
        def parse(self, *args, **kwargs):
            depth[0] += 1
            try:
                result = original(self, *args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                raise _Parsed(result)
            return result

        return parse

    for name, original in originals.items():
        setattr(argparse.ArgumentParser, name, wrap(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(argparse.ArgumentParser, name, original)


def parse_script(script: str, args: list[str]) -> None:
    """The script's parser accepts `args` (its main() stops right after parsing)."""
    main = runpy.run_path(str(ROOT / script), run_name="readme_check")["main"]
    err = io.StringIO()
    with stop_after_parsing(), contextlib.redirect_stderr(err):
        try:
            main(args)
        except _Parsed:
            return
        except SystemExit:
            raise AssertionError(f"{script} {shlex.join(args)}: {err.getvalue()}") from None
    raise AssertionError(f"{script} never parsed its arguments")


def check_training(args: list[str]) -> None:
    """scripts/train.py's arguments: Hydra flags, then overrides the config check accepts."""
    sweep = "-m" in args
    overrides = [a for a in args if not a.startswith("-") and a != "..."]
    if sweep:  # one point of the grid: the first value of each swept key
        overrides = [re.sub(r"=([^,\[{]+),.*", r"=\1", o) for o in overrides]
    overrides = [o for o in overrides if not o.startswith("hydra.")]
    try:
        check(CONF, overrides)
    except ConfigError as err:
        raise AssertionError(f"scripts/train.py {shlex.join(args)}: {err}") from None


def check_torchrun(args: list[str]) -> None:
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args([a for a in args if a != "..."])
    assert parsed.training_script == "scripts/train.py", parsed.training_script
    check_training(parsed.training_script_args)


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][\w-]*):", text, re.M))


@functools.cache
def made_by_makefile() -> frozenset[str]:
    """The files Makefile rules write, as expanded paths (`data/demo/mds/meta.json`, ...)."""
    database = subprocess.run(
        ["make", "-pq", "-f", str(ROOT / "Makefile")], cwd=ROOT, capture_output=True, text=True
    ).stdout  # -q: nothing runs; the exit status says whether targets are up to date
    return frozenset(re.findall(r"^([\w./-]+/[\w.-]+):", database, re.M))


@functools.cache
def shipped_files() -> tuple[str, ...]:
    """The repository's files (git ls-files), relative to its root."""
    listing = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    return tuple(listing.stdout.split())


def check_demo_paths(args: list[str]) -> None:
    """A README command's path under data/demo/ is one a make rule writes, a folder of one, or
    the tokenizer.json data_prep writes beside a meta.json: no file a newcomer cannot find after
    `make demo` / `make finetune-demo`."""
    made = set(made_by_makefile())
    made |= {str(Path(f).with_name("tokenizer.json")) for f in made if f.endswith("/meta.json")}
    folders = {str(Path(f).parent) for f in made}
    for arg in args:
        if arg.startswith("data/demo/"):
            assert arg in made or arg.rstrip("/") in folders, f"{arg}: no make rule writes it"
        if "*" in arg and "/" in arg:  # a glob over files (not a --glob value like '*.txt')
            assert fnmatch.filter([*made, *shipped_files()], arg), (
                f"{arg}: matches no file the repo ships or a make rule writes"
            )


def pip_extras() -> set[str]:
    return set(importlib.metadata.metadata("llmfoundry").get_all("Provides-Extra") or ())


def check_command(words: list[str]) -> None:
    program, *args = words
    if program == "make":
        targets = {a for a in args if not re.match(r"^[A-Z_]+=", a)}  # (VAR=value: a setting)
        assert targets <= make_targets(), f"make {' '.join(args)}: no such target"
    elif program == "docker":
        assert args[:1] == ["push"], f"docker {args[:1]}: build with make image"
    elif program == "pip":
        (spec,) = [a for a in args if "[" in a]
        extras = set(re.search(r"\[(.*)\]", spec).group(1).split(","))
        assert extras <= pip_extras(), f"pip install {spec}: unknown extras"
    elif program == "export" or re.match(r"^\w+=", program):
        pass  # variables: their use is checked with the commands
    elif program == "torchrun":
        check_torchrun(args)
    elif program == "python" and args[:1] == ["-c"]:
        compile(args[1], "<README python -c>", "exec")
    elif program == "python" and args[0] == "scripts/torchrun.py":  # torchrun's own parser
        check_torchrun(args[1:])
    elif program == "python" and args[0] == "scripts/train.py":
        check_training(args[1:])
    elif program == "python":
        assert (ROOT / args[0]).is_file(), f"{args[0]} does not exist"
        check_demo_paths(args[1:])
        parse_script(args[0], expand(args[1:]))
    else:
        raise AssertionError(f"no check for {program!r} (add one to check_command)")


def expand(args: list[str]) -> list[str]:
    """Shell variables the block set (`STORE=...`, `$STORE`), as the shell expands them."""
    return [os.path.expandvars(a) for a in args]


def test_every_shell_command_is_valid(monkeypatch):
    checked = 0
    for block in readme_blocks():
        if block.lang != "bash" or VALIDATED not in (claimed(block) or ""):
            continue
        for words in commands(block):
            if re.match(r"^\w+=", words[0]):  # STORE='{...}': later commands use $STORE
                name, _, value = words[0].partition("=")
                monkeypatch.setenv(name, value)
            check_command(words)
            checked += 1
    assert checked >= 30, checked


def test_a_stale_command_fails_the_check():
    with pytest.raises(AssertionError, match="unrecognized arguments: --no-such-flag"):
        check_command(["python", "scripts/generate.py", "ckpt", "--no-such-flag"])
    with pytest.raises(AssertionError, match="model.n_layer: unknown key"):
        check_command(["python", "scripts/train.py", "model.n_layer=2"])
    with pytest.raises(AssertionError, match="no such target"):
        check_command(["make", "demo-slow"])
    with pytest.raises(AssertionError, match="no make rule writes it"):
        check_command(["python", "scripts/eval.py", "ckpt", "data/demo/tasks/other.jsonl"])
    with pytest.raises(AssertionError, match="matches no file the repo ships"):
        check_command(["python", "scripts/eval.py", "ckpt", "tasks/*.jsonl"])


def test_config_error_examples_are_what_the_check_says():
    """The Configuration section's `$ python scripts/train.py ...` lines and their errors."""
    (block,) = [b for b in readme_blocks() if b.head.startswith("$ python scripts/train.py")]
    lines = block.text.splitlines()
    for command, shown in zip(lines[::2], lines[1::2], strict=True):
        overrides = shlex.split(command)[3:]
        with pytest.raises(ConfigError) as err:
            check(CONF, overrides)
        assert f"Config error: {err.value}".startswith(shown.removesuffix("...")), shown


def test_algorithm_excerpt_is_the_shipped_code():
    """The Writing-an-algorithm excerpt: its lines are the shipped file's, in their order."""
    block = readme_block("class RandomTokenReplacement(Algorithm):")
    source = iter(
        (ROOT / "llmfoundry/algorithms/random_token_replacement.py").read_text().splitlines()
    )
    missing = [line for line in block.text.splitlines() if line.strip() and line not in source]
    assert not missing, f"not in the shipped file (in this order): {missing}"


# ---------------------------------------------------------------------------------------------
# Blocks run for real.


def readme_block(head: str) -> Block:
    (block,) = [b for b in readme_blocks() if b.head.startswith(head)]
    return block


@pytest.mark.slow
def test_own_model_blocks_train_and_write_a_run_folder(tmp_path):
    for head in ("# my_model.py", "# train_my_model.py"):
        name = head.split()[1].rstrip(",")
        (tmp_path / name).write_text(readme_block(head).text)
    result = subprocess.run(
        [sys.executable, "train_my_model.py"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[eval @ batch 32]" in result.stdout and "[batch 8] loss/train" in result.stdout
    run_dir = tmp_path / "outputs" / "my-llama"
    assert "[eval @ batch 32]" in (run_dir / "train.log").read_text()
    first, last = re.search(
        r"eval/val/loss: first ([\d.]+) -> last ([\d.]+)", result.stdout
    ).groups()
    assert float(last) < float(first) / 2  # it learned to continue the rows
    assert (run_dir / "metrics.jsonl").stat().st_size > 0


# Training overrides that make a README training command a few seconds' run: a key the command
# sets is replaced, the others are appended.
TINY_TRAINING = {
    "max_duration": "2ba",
    "save_interval": "1ba",
    "model.d_model": "32",
    "model.n_heads": "2",
    "model.n_layers": "1",
    "global_train_batch_size": "2",
    "eval_interval": "2ba",
    "eval_subset_num_batches": "1",
    "scheduler.t_warmup": "1ba",
    "callbacks": "[run_status]",
    "loggers": "[console,jsonl]",
}


def tiny_training(line: str) -> str:
    """A `python scripts/train.py ...` line (continuations joined) with TINY_TRAINING."""
    words = line.split()
    given = {w.split("=", 1)[0]: i for i, w in enumerate(words) if "=" in w}
    for key, value in TINY_TRAINING.items():
        if key in given:
            words[given[key]] = f"{key}={value}"
        else:
            words.append(f"{key}={value}")
    return " ".join(words)


def as_script(block: Block, endpoint: str, train: bool = True) -> str:
    """The block as a bash script for a checkout at the working directory: the store is moto's,
    training commands are tiny (or left out: `train`), `python` is this interpreter."""
    lines = []
    for line in block.text.replace("\\\n", " ").splitlines():
        line = line.replace("http://localhost:9000", endpoint)
        if line.startswith("python scripts/train.py") and not train:
            continue
        if line.startswith("python scripts/train.py"):
            line = tiny_training(line)
        lines.append(re.sub(r"^python ", f"{sys.executable} ", line))
    return "\n".join(lines) + "\n"


@pytest.mark.slow
def test_zero_to_s3_steps_run_with_tiny_training(s3_endpoint, monkeypatch, tmp_path):
    """ "From zero to S3" steps 1 and 2 as bash scripts in a checkout-like folder (my_corpus/ of
    text files, the store on moto, training tiny), then `runs.py` lists both runs: the S3 run's
    checkpoint read with the endpoint its config saved (the environment has none)."""
    for folder in ("scripts", "data_prep"):
        (tmp_path / folder).symlink_to(ROOT / folder)
    corpus = tmp_path / "my_corpus"
    corpus.mkdir()
    for i, path in enumerate(sorted((ROOT / "llmfoundry").rglob("*.py"))[:25]):
        (corpus / f"doc{i}.txt").write_text(path.read_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "LLMFOUNDRY_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", AWS_DEFAULT_REGION="us-east-1")
    # runs.py in the shell of step 2, as a user goes on (its credentials exported, no endpoint).
    (runs_command,) = [c for c in commands(readme_block("python scripts/runs.py")) if len(c) == 2]
    step_1 = as_script(readme_block("python data_prep/text_to_tokens.py"), s3_endpoint, train=False)
    step_2 = as_script(readme_block("export AWS_ACCESS_KEY_ID="), s3_endpoint)
    step_2 += f"{sys.executable} {shlex.join(runs_command[1:])}\n"
    for script in (step_1, step_2):
        result = subprocess.run(
            ["bash", "-e", "-c", script],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert result.returncode == 0, f"{script}\n{result.stdout}\n{result.stderr}"
    assert (tmp_path / "outputs" / "mine" / "status.json").is_file()
    (row,) = [line for line in result.stdout.splitlines() if line.startswith("mine ")]
    assert row.split()[:3] == ["mine", "finished", "2/2"] and "ep0-ba2" in row, result.stdout


def test_own_model_commands_are_valid(tmp_path, monkeypatch):
    """ "Your own model"'s train.py and job file commands, checked as the others, with the
    README's my_model.py importable (as from the folder they are launched from); the real runs
    of a module of one's own: tests/e2e/test_user_model.py, tests/launch/test_render.py."""
    from .own_model import readme_module

    monkeypatch.setitem(sys.modules, "my_model", readme_module(tmp_path))
    (block,) = [b for b in readme_blocks() if b.head.startswith("python scripts/train.py model=c")]
    found = commands(block)
    for words in found:
        check_command(words)
    launch = next(w for w in found if w[1] == "scripts/launch.py")
    check_training([value for flag, value in itertools.pairwise(launch) if flag == "--train"])
    assert len(found) == 2
