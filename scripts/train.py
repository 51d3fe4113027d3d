"""Train a model (MPT or Llama: `model=`).

    python scripts/train.py                                  # the demo: mpt-tiny on data/demo/mds
    python scripts/train.py model=mpt-1b data.remote=s3://bucket/mds max_duration=10000ba
    torchrun --nproc_per_node=8 scripts/train.py model=mpt-1b ...
    python scripts/train.py their-llm-foundry.yaml variables.data_local=DIR model.n_layers=2

Every value in conf/ can be overridden as key=value; `--cfg job` prints the composed config.
An llm-foundry train YAML as the first argument runs as llm-foundry would run it, its
key=value overrides in its own schema (llmfoundry/config/foundry/; `--cfg job` prints the config
it became here, scripts/from_foundry.py writes it as a conf/experiment file).
Sweeps: `-m optimizer.lr=1e-3,3e-3 model.n_layers=2,4` (a grid), or an Optuna search space from
conf/sweep/: `-m +sweep=tiny_lr` (README, Sweeps).
A problem with the config or the inputs (a missing data folder, strategy=ddp without torchrun)
is one line on stderr and exit status 2; `--debug` (or LLMFOUNDRY_DEBUG=1) shows its traceback.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import shutil
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

# Only what checking and printing the config needs is imported here: the trainer (and torch,
# seconds to import) comes in main(), so `--cfg job` and a config error answer in about a second.
from llmfoundry.config import register_resolvers
from llmfoundry.config.preflight import preflight
from llmfoundry.config.run_files import redacted_yaml, write_run_config
from llmfoundry.utils.errors import exit_on_user_error, split_debug_flag
from llmfoundry.utils.logs import configure_logging

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
DEBUG = False
# Hydra's flags that take a value (`--cfg job`): kept together when an llm-foundry YAML's
# key=value arguments are separated from the flags.
_VALUED_FLAGS = ("--cfg", "-c", "--package", "-p")


def from_foundry_argv(argv: list[str], debug: bool) -> list[str]:
    """Hydra's arguments for `train.py their.yaml [key=value ...] [flags]`: the YAML (with its
    overrides, in llm-foundry's schema) translated to ours; its inputs (an imported
    transformers folder, instruction rows) made first unless only the config is printed.
    Hydra's own settings (``hydra.run.dir=FOLDER``: where the run folder is, as scripts/launch.py
    sets it for every run) are not training config: they go to Hydra as given, like its flags."""
    from llmfoundry.config.foundry import describe, load, translate
    from llmfoundry.config.foundry.prep import make

    flags, args, rest = [], [], iter(argv[1:])
    for arg in rest:
        if arg in _VALUED_FLAGS:
            flags += [arg, next(rest, "")]
        elif arg.startswith(("-", "hydra.")):
            flags.append(arg)
        else:
            args.append(arg)
    with exit_on_user_error(debug, prefix="Config error"):
        native = translate(load(argv[0], args), os.environ)
    for note in native.notes:
        print(f"llm-foundry {note}", file=sys.stderr)
    if not any(flag in ("--cfg", "-c") for flag in flags):
        for step in native.prep:
            print(f"preparing: {describe(step)}", file=sys.stderr)
            with exit_on_user_error(debug):
                make(step)
    return native.overrides() + flags


def _only_setup_files(run_dir: Path, lock_file: str) -> bool:
    """Whether the run folder holds only what is written before training starts (the saved
    config, train.log, folder locks): a run that fails with nothing else there leaves no folder
    behind (`make plot` would pick it as the latest run)."""
    for path in run_dir.rglob("*"):
        relative = path.relative_to(run_dir).parts
        if path.is_file() and relative[0] != ".hydra" and path.name not in ("train.log", lock_file):
            return False
    return True


@hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float:
    """Train; return the final validation loss, which sweepers (-m, hydra/sweeper=optuna) minimise."""
    from llmfoundry.build import build_trainer
    from llmfoundry.checkpoint.lock import LOCK_FILE
    from llmfoundry.config.next_steps import launcher_of, next_steps
    from llmfoundry.launch.sweeps import objective
    from llmfoundry.models.custom import FSDP_BLOCKS_KEY
    from llmfoundry.tokenizers.tokenizer import tokenizer_exists

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    configure_logging(run_dir / "train.log")  # the console's lines, kept in the run folder
    # A folder locked before this launch may belong to a running run that refuses this one.
    locked_before = (run_dir / LOCK_FILE).exists()
    try:
        with exit_on_user_error(DEBUG):
            trainer = build_trainer(
                cfg,
                run_dir,
                # Once the folder is this run's: a refused launch must not rewrite a running
                # run's saved config.
                write_run_files=functools.partial(
                    write_run_config, run_dir, cfg, hydra_cfg, hydra_cfg.overrides.task
                ),
            )
    except SystemExit:
        if not locked_before and _only_setup_files(run_dir, LOCK_FILE):
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    with exit_on_user_error(DEBUG):
        state = trainer.fit()
    if state.rank == 0:
        overrides = hydra_cfg.overrides.task
        launcher = launcher_of(dict(os.environ))
        # Token files made elsewhere come without a tokenizer: the commands then name one.
        found = isinstance(cfg.tokenizer, str) and tokenizer_exists(cfg.tokenizer)
        print(
            next_steps(
                run_dir,
                cfg.run_name,
                cfg.save_folder,
                overrides,
                launcher=launcher,
                tokenizer_found=found,
                own_module=FSDP_BLOCKS_KEY in cfg.model,  # conf/model/custom.yaml's key
                storage=OmegaConf.to_container(cfg.storage, resolve=True),
            )
        )
    return objective(state)


if __name__ == "__main__":
    # `_target_: my_callbacks.MyCallback` finds my_callbacks.py in the folder the run is launched
    # from, as `python -m` would; installed packages come first.
    sys.path.append(os.getcwd())
    sys.argv[1:], DEBUG = split_debug_flag(sys.argv[1:])
    if sys.argv[1:] and sys.argv[1].endswith((".yaml", ".yml")):
        sys.argv[1:] = from_foundry_argv(sys.argv[1:], DEBUG)
    if DEBUG:
        os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra's own report keeps the whole traceback
    register_resolvers()
    preflight(sys.argv[1:], CONF_DIR, debug=DEBUG)
    if any(arg == "-c" or arg.startswith("--cfg") for arg in sys.argv[1:]):
        # Hydra prints the config itself: as the run would save it, without credentials.
        shown = io.StringIO()
        try:
            with contextlib.redirect_stdout(shown):
                main()
        finally:
            sys.stdout.write(redacted_yaml(shown.getvalue()))
    else:
        main()
