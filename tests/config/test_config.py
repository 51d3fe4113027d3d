import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra.utils import get_object
from omegaconf import OmegaConf

from llmfoundry.config import ConfigError, default_run_name, validate_config
from llmfoundry.config.parallelism import resolve_aliases
from llmfoundry.config.preflight import check, compose_config
from llmfoundry.config.run_name import check_run_name

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"


def error_for(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        check(CONF, list(overrides))
    return str(info.value)


def test_default_config_is_valid():
    check(CONF, [])


# The recipe's own values in the algorithm, callback and logger yamls (not their defaults).
CHOSEN = {
    "algorithms/ema.yaml": {"half_life"},
    "callbacks/early_stopper.yaml": {"patience"},
    "callbacks/generate.yaml": {"prompts", "max_new_tokens"},
    "loggers/console.yaml": {"log_interval"},
    "loggers/wandb.yaml": {"project"},
}


@pytest.mark.parametrize(
    "path",
    sorted(
        str(p.relative_to(CONF))
        for group in ("converters", "algorithms", "callbacks", "loggers")
        for p in (CONF / group).glob("*.yaml")
        if p != CONF / "algorithms/low_precision_layernorm.yaml"  # selects the converter
    ),
)
def test_group_configs_list_every_argument(path):
    """Each converter, algorithm, callback and logger yaml lists every argument of its target, so
    `callbacks.x.key=value` works without `+`; a value the yaml does not choose is the default."""
    node = OmegaConf.to_container(OmegaConf.load(CONF / path))
    params = inspect.signature(get_object(node["_target_"])).parameters.values()
    defaults = {
        p.name: p.default
        for p in params
        if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD
    }
    assert sorted(k for k in node if not k.startswith("_")) == sorted(defaults)
    chosen = CHOSEN.get(path, set()) | {
        k for k, v in node.items() if isinstance(v, str) and ("${" in v or v == "???")
    }
    assert {k: v for k, v in node.items() if not k.startswith("_") and k not in chosen} == {
        k: v for k, v in defaults.items() if k not in chosen
    }


# model=from_checkpoint needs a checkpoint: tests/e2e/test_finetune.py.
SIZES = sorted(p.stem for p in (CONF / "model").glob("*.yaml") if p.stem != "from_checkpoint")


@pytest.mark.parametrize("model", SIZES)
def test_every_model_config_is_valid(model):
    if model == "custom":  # your own module: its builder is the one key to give
        assert error_for("model=custom").startswith("model._target_: missing: model=custom")
        check(CONF, ["model=custom", "model._target_=torch.nn.Identity"])
    else:
        check(CONF, [f"model={model}"])


def test_misspelt_override_names_key_and_suggests():
    message = error_for("model.n_layer=2")
    assert message.startswith("model.n_layer: unknown key")
    assert "did you mean 'n_layers'" in message
    assert "d_model" in message and "n_heads" in message


def test_tensor_and_pipeline_parallel_outside_fsdp_name_the_strategy_that_has_them():
    assert error_for("strategy=ddp", "parallelism.tp=2") == (
        "parallelism.tp=2: strategy=ddp runs the whole model on every process, without tensor "
        "parallelism; use strategy=fsdp, or tp=1"
    )
    assert error_for("strategy=deepspeed_zero3", "parallelism.pp=2") == (
        "parallelism.pp=2: strategy=deepspeed_zero3 runs the whole model on every process, "
        "without pipeline parallelism; use strategy=fsdp, or pp=1"
    )
    # The old keys are FSDP's aliases only (conf/strategy/fsdp.yaml): elsewhere, the new key.
    assert error_for("strategy=ddp", "strategy.tp=2") == (
        "strategy.tp: tensor parallelism runs on strategy=fsdp, and the mesh is parallelism.tp "
        "now (strategy=fsdp parallelism.tp=...)"
    )
    assert error_for("strategy=ddp", "strategy.cp=1").startswith(
        "strategy.cp: context parallelism runs on strategy=fsdp"
    )
    assert error_for("strategy=ddp", "parallelism.ep=2") == (
        "parallelism.ep=2: strategy=ddp runs the whole model on every process, without expert "
        "parallelism; use strategy=fsdp, or ep=1"
    )
    check(CONF, ["strategy=fsdp", "parallelism.tp=2", "parallelism.pp=2"])


def test_old_strategy_mesh_keys_are_aliases_of_the_parallelism_block():
    cfg = compose_config(CONF, ["strategy=fsdp", "strategy.tp=2", "strategy.replicate=3"])
    assert resolve_aliases(cfg) == [
        "strategy.replicate=3 is parallelism.dp_replicate=3 now; use the new key",
        "strategy.tp=2 is parallelism.tp=2 now; use the new key",
    ]
    assert (cfg.parallelism.tp, cfg.parallelism.dp_replicate) == (2, 3)
    assert "tp" not in cfg.strategy and "replicate" not in cfg.strategy  # FSDP takes neither
    validate_config(cfg)
    # Saying the same thing twice is no contradiction; saying two things is refused.
    check(CONF, ["strategy=fsdp", "parallelism.pp=2", "strategy.pp=2"])
    assert error_for("strategy=fsdp", "parallelism.tp=2", "strategy.tp=4") == (
        "strategy.tp: 4 contradicts parallelism.tp=2; strategy.tp is the old name of "
        "parallelism.tp: set only parallelism.tp"
    )


def test_parallelism_block_keys_and_types_are_checked():
    assert error_for("parallelism.tpp=2").startswith("parallelism.tpp: unknown key; did you mean")
    assert error_for("parallelism.tp=two") == "parallelism.tp: expected int, got 'two' (str)"


def test_tensor_parallel_needs_a_sequence_length_it_divides():
    assert error_for("strategy=fsdp", "parallelism.tp=4", "max_seq_len=126") == (
        "max_seq_len=126 is not a multiple of 4 (tp=4): the mesh splits every sequence into "
        "that many parts; choose a max_seq_len that is one"
    )
    check(CONF, ["strategy=fsdp", "parallelism.tp=4", "max_seq_len=128"])


def test_misspelt_key_added_with_plus_is_caught_too():
    message = error_for("+model.n_layer=2")
    assert message.startswith("model.n_layer: unknown key") and "n_layers" in message


def test_unknown_top_level_key():
    assert error_for("+max_durations=10ba").startswith(
        "max_durations: unknown key; did you mean 'max_duration'"
    )


def test_wrong_type_names_key():
    message = error_for("model.d_model=abc")
    assert message.startswith("model.d_model: expected int, got 'abc'")


def test_impossible_combination():
    message = error_for("model.d_model=100", "model.n_heads=3")
    assert message.startswith("model:") and "d_model" in message and "n_heads" in message


def test_bad_time_string():
    assert error_for("max_duration=10 batches").startswith("max_duration:")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "model=mpt-2b",
            "model: no option 'mpt-2b'; did you mean 'mpt-7b'? allowed: custom, from_checkpoint",
        ),
        ("algorithms=[ema,emma]", "algorithms: no option 'emma'; did you mean 'ema'?"),
        ("converters=[low_precision]", "converters: no option 'low_precision'; did you mean"),
    ],
)
def test_unknown_group_option_is_one_line_listing_the_options(override, message):
    assert error_for(override).startswith(message) and "\n" not in error_for(override)


def test_seq_len_longer_than_model():
    assert error_for("max_seq_len=100000").startswith(
        "max_seq_len: 100000 exceeds model.max_seq_len"
    )


def test_algorithms_switch_on_from_command_line():
    cfg = compose_config(CONF, ["algorithms=[gradient_clipping,random_token_replacement]"])
    assert list(cfg.algorithms) == ["gradient_clipping", "random_token_replacement"]
    validate_config(cfg)
    cfg = compose_config(CONF, ["+algorithms.mine._target_=llmfoundry.algorithms.GradientClipping"])
    assert list(cfg.algorithms) == ["gradient_clipping", "mine"]


def test_validate_config_returns_settings():
    settings = validate_config(compose_config(CONF, ["global_train_batch_size=8"]))
    assert settings.global_train_batch_size == 8


def test_bad_config_from_command_line_is_one_message_within_seconds():
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train.py"), "model.n_layer=2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip().splitlines()[0]], (
        result.stderr
    )
    assert "model.n_layer: unknown key; did you mean 'n_layers'?" in result.stderr
    assert "Traceback" not in result.stderr
    assert time.monotonic() - started < 30


def test_run_name_is_shared_by_ranks_of_one_launch():
    env = {
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29511",
        "TORCHELASTIC_RUN_ID": "none",
    }
    rank0 = default_run_name({**env, "RANK": "0"}, now=1.0)
    rank1 = default_run_name({**env, "RANK": "1"}, now=2.0)
    assert rank0 == rank1 == "run-127-0-0-1-29511"
    assert default_run_name({"TORCHELASTIC_RUN_ID": "0123456789abcdef"}) == "run-01234567"
    assert default_run_name({}, now=0.0) != default_run_name({}, now=10.0)


def test_config_error_from_omegaconf_interpolation():
    cfg = compose_config(CONF, [])
    cfg = OmegaConf.merge(cfg, {"tokenizer": "${missing_key}"})
    with pytest.raises(ConfigError):
        validate_config(cfg)


def test_max_duration_in_dur_is_refused():
    message = error_for("max_duration=0.5dur")
    assert message.startswith("max_duration: ") and "'dur'" in message and "ba" in message


@pytest.mark.parametrize("key", ["eval_interval", "save_interval"])
def test_zero_interval_is_refused(key):
    message = error_for(f"{key}=0ba")
    assert message.startswith(f"{key}: ") and "null" in message


def test_time_strings_with_underscores_and_compound_wall_clock_are_valid():
    check(CONF, ["max_duration=1h30m", "eval_interval=4_000tok", "scheduler.t_warmup=1_000tok"])


def test_time_string_of_a_target_is_checked():
    message = error_for("scheduler.t_warmup=abc")
    assert message.startswith("scheduler.t_warmup: cannot parse time 'abc'")


def test_amp_fp16_on_cpu_is_a_config_error(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    message = error_for("precision=amp_fp16")
    assert message.startswith("precision: amp_fp16 needs a CUDA device")
    assert "fp32" in message and "amp_bf16" in message
    assert error_for("precision=amp_fp16", "strategy.device=cpu").startswith("precision:")


def test_context_parallel_needs_a_sequence_length_its_chunks_divide():
    message = error_for("strategy=fsdp", "parallelism.cp=4", "max_seq_len=132")
    assert message == (
        "max_seq_len=132 is not a multiple of 8 (2 x cp=4): the mesh splits every sequence into "
        "that many parts; choose a max_seq_len that is one"
    )
    check(CONF, ["strategy=fsdp", "parallelism.cp=4", "max_seq_len=128"])


def test_enum_lists_allowed_values():
    message = error_for("precision=bf16")
    assert message == (
        "precision: expected one of 'auto', 'fp32', 'amp_bf16', 'amp_fp16', 'amp_fp8', got 'bf16' "
        "(str)"
    )


def test_misspelt_top_level_override_gets_a_suggestion():
    message = error_for("max_duraton=10ba")
    assert message.startswith("max_duraton: unknown key; did you mean 'max_duration'?")


# scripts/train.py run as a user does, once per command line, in one subprocess (a fresh
# interpreter: torch not yet imported); per case its exit status, stderr, stdout and whether
# torch was imported by then.
_TRAIN_CASES = r"""
import contextlib, io, json, runpy, sys
results = []
for argv in json.loads(sys.argv[1]):
    sys.argv = ["scripts/train.py", *argv]
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path("scripts/train.py", run_name="__main__")
        except SystemExit as exit:
            code = exit.code
    results.append([code, err.getvalue(), out.getvalue(), "torch" in sys.modules])
print(json.dumps(results))
"""


def test_config_errors_and_cfg_job_answer_before_torch_is_imported():
    cases = [
        ["model.n_layer=2"],  # unknown key of the model
        ["max_durationn=10ba"],  # unknown top-level key
        ["max_duration=abc"],  # bad value
        ["model.n_layers=two"],  # bad value of the model
        ["optimizer.lr=abc"],  # bad value of the optimizer
        ["data.num_wrkers=2"],  # unknown key of the data group
        ["+callbacks.speed_monitor.window=3"],  # unknown key of a callback
        ["loggers.jsonl.flush_interval=abc"],  # bad time string of a logger
        ["algorithms=[ema]", "algorithms.ema.half_life=abc"],  # ... of an algorithm
        ["scheduler.alpha_f=x"],  # bad value of the scheduler
        ["--cfg", "job", "model.n_layers=3"],
    ]
    result = subprocess.run(
        [sys.executable, "-c", _TRAIN_CASES, json.dumps(cases)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    results = json.loads(result.stdout)
    expected = [
        "Config error: model.n_layer: unknown key; did you mean 'n_layers'?",
        "Config error: max_durationn: unknown key; did you mean 'max_duration'?",
        "Config error: max_duration: cannot parse time 'abc'",
        "Config error: model.n_layers: expected int, got 'two'",
        "Config error: optimizer.lr: expected float, got 'abc' (str)",
        "Config error: data.num_wrkers: unknown key; did you mean 'num_workers'?",
        "Config error: callbacks.speed_monitor.window: unknown key; did you mean 'window_size'?",
        "Config error: loggers.jsonl.flush_interval: cannot parse time 'abc'",
        "Config error: algorithms.ema.half_life: cannot parse time 'abc'",
        "Config error: scheduler.alpha_f: expected float, got 'x' (str)",
    ]
    for (code, err, _, torch_loaded), start in zip(results[:-1], expected, strict=True):
        assert code == 2 and len(err.splitlines()) == 1 and err.startswith(start), err
        assert not torch_loaded, f"checking the config imported torch before: {start}"
    code, err, out, torch_loaded = results[-1]
    assert code in (0, None) and "n_layers: 3" in out, err
    assert not torch_loaded, "--cfg job imported torch"


# scripts/train.py with run names that are not one folder name, run from a project folder that
# holds a file and another run (a user's checkout), in one interpreter (as _TRAIN_CASES).
_RUN_NAME_CASES = r"""
import contextlib, io, json, os, runpy, sys
script, results = os.path.abspath("scripts/train.py"), []
os.chdir(sys.argv[2])
for name in json.loads(sys.argv[1]):
    sys.argv = [script, f"run_name={name}"]
    err, code = io.StringIO(), 0
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exit:
            code = exit.code
    results.append([code, err.getvalue()])
print(json.dumps(results))
"""


def test_a_run_name_that_is_not_one_folder_name_is_refused_before_any_folder(tmp_path):
    """Refused at config time, before Hydra makes the run folder: nothing is written anywhere
    (old: `..` made the project folder the run folder, `''` made outputs/ it, `../../x` wrote
    next to the project's parent)."""
    project = tmp_path / "home" / "project"
    (project / "outputs" / "other-run").mkdir(parents=True)
    (project / "README.md").write_text("mine")
    (project / "outputs" / "other-run" / "metrics.jsonl").write_text("{}\n")
    before = sorted(tmp_path.rglob("*"))
    names = ["..", "", "../../x"]
    result = subprocess.run(
        [sys.executable, "-c", _RUN_NAME_CASES, json.dumps(names), str(project)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for name, (code, err) in zip(names, json.loads(result.stdout), strict=True):
        assert code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"Config error: run_name: {name!r} is not one folder name"), err
        assert "e.g. run_name=my-run-2" in err
    assert sorted(tmp_path.rglob("*")) == before  # nothing written, nothing removed


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("mpt-1b_lr=3e-3+warmup.v2", True),
        ("_x", True),
        ("a" * 128, True),
        ("a" * 129, False),
        (".", False),
        (".hidden", False),
        ("-x", False),
        ("a/b", False),
        ("a\\b", False),
        ("a b", False),
        ("a\x1b[2Jb", False),
        ("a\nb", False),
        ("r\u00e9sum\u00e9", False),
    ],
)
def test_run_name_rule(name, ok):
    if ok:
        check_run_name(name)
        return
    with pytest.raises(ConfigError) as info:
        check_run_name(name)
    assert "\n" not in str(info.value) and "\x1b" not in str(info.value)


def test_default_run_names_follow_the_rule():
    """Rendezvous ids and addresses come from the user (`--rdzv-id`, an IPv6 MASTER_ADDR)."""
    for env in (
        {"TORCHELASTIC_RUN_ID": "../../x"},
        {"WORLD_SIZE": "2", "MASTER_ADDR": "::1", "MASTER_PORT": "29500"},
        {},
    ):
        check_run_name(default_run_name(env))


def test_the_block_checked_before_torch_has_the_meshs_keys():
    """config/parallelism.py checks the block without importing torch, by a copy of the mesh's
    fields: the copy must not drift from ParallelDims (a key training takes, refused here)."""
    from dataclasses import fields

    from llmfoundry.config.parallelism import Parallelism
    from llmfoundry.distributed.mesh import PARALLELISM_KEYS, ParallelDims

    assert tuple(f.name for f in fields(Parallelism)) == PARALLELISM_KEYS
    defaults = {f.name: f.default for f in fields(ParallelDims) if f.name != "world_size"}
    assert {f.name: f.default for f in fields(Parallelism)} == defaults
