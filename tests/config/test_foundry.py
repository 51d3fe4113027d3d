"""llm-foundry train YAMLs -> our config (llmfoundry/config/foundry/): every key of their schema
mapped, noted or refused in one line; the translation composes with conf/ and validates."""

from __future__ import annotations

import copy
import json
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from llmfoundry.config.foundry import describe, load, translate
from llmfoundry.config.foundry.common import composer_time
from llmfoundry.config.foundry.prep import make
from llmfoundry.config.foundry.translate import HANDLED, NOTED, REFUSED_UNLESS
from llmfoundry.config.preflight import check, compose_config
from llmfoundry.config.train_config import validate_config
from llmfoundry.core.time import Time
from llmfoundry.utils.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
FIXTURES = ROOT / "tests" / "fixtures" / "foundry"

# The fields of llm-foundry 0.22.0's TrainConfig (llmfoundry/utils/config_utils.py,
# TRAIN_CONFIG_KEYS), as that release lists them.
TRAIN_CONFIG_KEYS = {
    "accumulate_train_batch_on_tokens", "algorithms", "autoresume", "callbacks", "code_paths",
    "compile_config", "console_log_interval", "cuda_load_lazy", "device_eval_batch_size",
    "device_train_batch_size", "device_train_grad_accum", "device_train_microbatch_size",
    "dist_timeout", "eval_first", "eval_gauntlet", "eval_gauntlet_str", "eval_interval",
    "eval_loader", "eval_loaders", "eval_subset_num_batches", "expandable_segments",
    "flatten_metadata", "fsdp_config", "global_train_batch_size", "icl_seq_len",
    "icl_subset_num_batches", "icl_tasks", "icl_tasks_str", "load_ignore_keys", "load_path",
    "load_strict_model_weights", "load_weights_only", "log_config", "log_to_console", "loggers",
    "max_duration", "max_seq_len", "max_split_size_mb", "metadata", "model", "n_gpus",
    "only_composer_checkpoint", "only_hf_checkpoint", "optimizer", "precision", "profiler",
    "progress_bar", "python_log_level", "run_name", "save_filename", "save_folder",
    "save_ignore_keys", "save_interval", "save_latest_filename", "save_num_checkpoints_to_keep",
    "save_overwrite", "save_weights_only", "scheduler", "seed", "spin_dataloaders", "tokenizer",
    "tp_config", "train_loader", "train_subset_num_batches", "variables",
}  # fmt: skip

# An llm-foundry pretraining YAML of our own in their schema (as scripts/train/yamls/pretrain's
# CPU recipe is laid out), for a 2-layer MPT.
FOUNDRY_YAML = """
variables:
  data_local: ./my-mds
  data_remote:
  max_seq_len: 32
  global_seed: 5
  run_name: tiny-foundry
max_seq_len: ${variables.max_seq_len}
run_name: ${variables.run_name}
model:
  name: mpt_causal_lm
  init_device: cpu
  d_model: 32
  n_heads: 4
  n_layers: 2
  expansion_ratio: 4
  max_seq_len: ${variables.max_seq_len}
  vocab_size: 300
  attn_config:
    attn_impl: torch
  loss_fn: torch_crossentropy
tokenizer:
  name: ./my-mds/tokenizer.json
  kwargs:
    model_max_length: ${variables.max_seq_len}
train_loader:
  name: text
  dataset:
    local: ${variables.data_local}
    remote: ${variables.data_remote}
    split: train
    shuffle: true
    max_seq_len: ${variables.max_seq_len}
    shuffle_seed: ${variables.global_seed}
  drop_last: true
  num_workers: 0
eval_loader:
  name: text
  dataset:
    local: ${variables.data_local}
    remote: ${variables.data_remote}
    split: val
    shuffle: false
    max_seq_len: ${variables.max_seq_len}
  drop_last: false
  num_workers: 0
scheduler:
  name: cosine_with_warmup
  t_warmup: 2ba
  alpha_f: 0.1
optimizer:
  name: decoupled_adamw
  lr: 6.0e-3
  betas: [0.9, 0.95]
  eps: 1.0e-08
  weight_decay: 0.0
algorithms:
  gradient_clipping:
    clipping_type: norm
    clipping_threshold: 1.0
max_duration: 4ba
eval_interval: 2ba
eval_first: false
eval_subset_num_batches: 2
global_train_batch_size: 8
seed: ${variables.global_seed}
device_eval_batch_size: 4
device_train_microbatch_size: 4
precision: fp32
fsdp_config:
  sharding_strategy: FULL_SHARD
  mixed_precision: PURE
  activation_checkpointing: false
  activation_checkpointing_reentrant: false
  activation_cpu_offload: false
  limit_all_gathers: true
progress_bar: false
log_to_console: true
console_log_interval: 1ba
callbacks:
  speed_monitor:
    window_size: 10
  lr_monitor: {}
  memory_monitor: {}
  runtime_estimator: {}
save_folder: ./ckpt/{run_name}
save_interval: 2ba
save_overwrite: true
save_num_checkpoints_to_keep: 1
"""


@pytest.fixture
def foundry_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The YAML as foundry.yaml beside a my-mds folder with a tokenizer.json (cwd: there)."""
    (tmp_path / "my-mds").mkdir()
    (tmp_path / "my-mds" / "tokenizer.json").write_text("{}")
    (tmp_path / "foundry.yaml").write_text(FOUNDRY_YAML)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RUN_NAME", raising=False)
    return tmp_path


def base() -> dict:
    """The YAML resolved, as `load` returns it."""
    cfg = OmegaConf.create(FOUNDRY_YAML)
    return OmegaConf.to_container(cfg, resolve=True)


def composed(native) -> OmegaConf:
    cfg = compose_config(CONF, native.overrides())
    validate_config(cfg)
    return cfg


def test_every_key_of_their_train_schema_is_mapped_noted_or_refused():
    assert set(HANDLED) | set(NOTED) | set(REFUSED_UNLESS) == TRAIN_CONFIG_KEYS
    assert not set(HANDLED) & set(NOTED) and not set(HANDLED) & set(REFUSED_UNLESS)


def test_their_yaml_with_their_overrides_composes_as_our_config(foundry_dir):
    cfg = load("foundry.yaml", ["variables.max_seq_len=64", "model.n_layers=3"])
    native = translate(cfg, {})
    out = composed(native)
    # Interpolations follow the overridden variable; their MPT defaults, not ours.
    assert (out.max_seq_len, out.model.max_seq_len, out.model.n_layers) == (64, 64, 3)
    assert (out.model.alibi, out.model.learned_pos_emb, out.model.no_bias) == (False, True, False)
    assert out.model.low_precision_layernorm and out.model.attn_impl == "sdpa"
    assert (out.data.remote, out.data.local, out.data.train_split) == ("./my-mds", None, "train")
    assert (out.data.eval_split, out.data.shuffle_seed, out.data.drop_last) == ("val", 5, True)
    assert out.tokenizer == "./my-mds/tokenizer.json"
    assert (out.optimizer.lr, list(out.optimizer.betas)) == (6e-3, [0.9, 0.95])
    assert (out.scheduler.t_warmup, out.scheduler.alpha_f) == ("2ba", 0.1)
    assert out.algorithms.gradient_clipping.threshold == 1.0
    assert list(out.callbacks) == [
        "speed_monitor",
        "lr_monitor",
        "memory_monitor",
        "runtime_estimator",
    ]
    assert out.callbacks.speed_monitor.window_size == 10
    assert list(out.loggers) == ["console", "jsonl"] and out.loggers.console.log_interval == "1ba"
    assert out.strategy._target_ == "llmfoundry.distributed.SingleDevice"
    assert (out.max_duration, out.eval_interval, out.eval_subset_num_batches) == ("4ba", "2ba", 2)
    assert (out.global_train_batch_size, out.device_train_microbatch_size) == (8, 4)
    assert (out.seed, out.run_name, out.precision) == (5, "tiny-foundry", "fp32")
    assert OmegaConf.to_container(out)["save_folder"] == "./ckpt/${run_name}"
    assert (out.save_interval, out.num_checkpoints_to_keep, out.save_overwrite) == ("2ba", 1, True)
    assert any(n.startswith("fsdp_config: one process") for n in native.notes)


def test_run_name_unset_is_read_from_RUN_NAME_as_llm_foundry_does(foundry_dir):
    cfg = base()
    cfg["run_name"] = None
    assert translate(cfg, {"RUN_NAME": "from-env"}).get("run_name") == "from-env"
    assert translate(cfg, {}).get("run_name") is None  # ours: the start time


@pytest.mark.parametrize(
    ("theirs", "ours"),
    [
        ("10ba", "10ba"),
        ("1ep", "1ep"),
        ("100tok", "100tok"),
        ("1000sp", "1000sp"),
        ("0.25dur", "0.25dur"),
        ("3e4tok", "30000tok"),
        (2, "2ep"),  # Composer counts a bare integer in epochs
        ("1h30m", "5400sec"),
    ],
)
def test_composer_times_keep_their_amount(theirs, ours):
    assert composer_time("max_duration", theirs) == ours
    assert Time.parse(ours) == Time.parse(ours)  # ours parses it
    if isinstance(theirs, str) and theirs.endswith(("ba", "ep", "tok", "sp")):
        assert Time.parse(ours).value == float(theirs.rstrip("abeopkts"))


@pytest.mark.parametrize("bad", ["2iter", "1.5ba", "ten ba", True])
def test_composer_times_we_cannot_count_are_refused(bad):
    with pytest.raises(UserError, match="llm-foundry key eval_interval"):
        composer_time("eval_interval", bad)


def _with(path: str, value):
    cfg = base()
    *parents, last = path.split(".")
    node = cfg
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return cfg


@pytest.mark.parametrize(
    ("path", "value", "named", "instead"),
    [
        ("dataset", {"hf_name": "json"}, "dataset", "not a key of llm-foundry's train config"),
        ("model.name", "hf_t5", "model.name", "encoder-decoder"),
        ("model.ffn_config", {"ffn_type": "mb_dmoe"}, "model.ffn_config.ffn_type", "DBRX"),
        ("model.peft_config", {"r": 8}, "model.peft_config", "LoRA"),
        (
            "model.attn_config",
            {"rope": True, "rope_dail_config": {"type": "xpos"}},
            "model.attn_config.rope_dail_config",
            "no xpos",
        ),
        ("tokenizer.name", "EleutherAI/gpt-neox-20b", "tokenizer.name", "save_pretrained"),
        (
            "callbacks.hf_checkpointer",
            {"save_folder": "x", "save_interval": "1ba", "mlflow_registered_model_name": "m"},
            "callbacks.hf_checkpointer.mlflow_registered_model_name",
            "no MLflow here",
        ),
        (
            "callbacks.hf_checkpointer",
            {"save_folder": "x"},
            "callbacks.hf_checkpointer.save_interval",
            "missing",
        ),
        (
            "callbacks.mono_checkpoint_saver",
            {},
            "callbacks.mono_checkpoint_saver",
            "conf/callbacks",
        ),
        ("loggers.mlflow", {}, "loggers.mlflow", "wandb and tensorboard"),
        ("optimizer.name", "adamw", "optimizer.name", "decoupled_adamw"),
        ("optimizer.amsgrad", True, "optimizer.amsgrad", "supported keys"),
        ("scheduler.t_max", "0.5dur", "scheduler.t_max", "max_duration"),
        ("icl_subset_num_batches", 2, "icl_subset_num_batches", "callbacks.icl_eval.limit"),
        ("save_weights_only", True, "save_weights_only", "export_hf"),
        ("load_ignore_keys", ["state/optimizers"], "load_ignore_keys", "load_weights_only"),
        ("fsdp_config.activation_cpu_offload", True, None, None),
        ("save_folder", "s3://b/{run_name}/{rank}", "save_folder", "{run_name}"),
        ("precision", "amp_fp32", "precision", "amp_bf16"),
        ("train_loader.dataset.max_seq_len", 16, "train_loader.dataset.max_seq_len", "equal"),
        ("train_loader.dataset.sampling_method", "fixed", None, "only"),
        ("device_train_batch_size", 4, "device_train_batch_size", "global_train_batch_size"),
    ],
)
def test_keys_we_cannot_honour_are_refused_in_one_line_naming_them(
    foundry_dir, path, value, named, instead
):
    with pytest.raises(UserError) as err:
        translate(_with(path, value), {"WORLD_SIZE": "2"})
    message = str(err.value)
    assert "\n" not in message
    assert f"llm-foundry key {named or path}" in message
    if instead:
        assert instead in message


def test_loggers_and_callbacks_take_composers_defaults(foundry_dir):
    cfg = base()
    cfg["loggers"] = {"wandb": {"project": "p", "tags": ["a"]}, "tensorboard": {}}
    cfg["callbacks"] = {"speed_monitor": {"gpu_flops_available": 1e12}}
    cfg["progress_bar"], cfg["console_log_interval"] = True, 5
    with pytest.raises(UserError, match="console_log_interval: 5ep: give it in batches"):
        translate(cfg, {})  # Composer counts a bare integer in epochs
    cfg["console_log_interval"] = "5ba"
    out = composed(translate(cfg, {}))
    assert list(out.loggers) == ["console", "progress", "jsonl", "wandb", "tensorboard"]
    assert (out.loggers.wandb.project, list(out.loggers.wandb.tags)) == ("p", ["a"])
    assert out.loggers.tensorboard.flush_interval == "100ba"  # Composer's default
    assert (out.callbacks.speed_monitor.window_size, out.callbacks.speed_monitor.peak_flops) == (
        100,
        1e12,
    )
    cfg["loggers"]["wandb"]["log_artifacts"] = True
    with pytest.raises(UserError, match="loggers.wandb.log_artifacts: True is not supported"):
        translate(cfg, {})


def test_fsdp_config_under_torchrun_is_our_fsdp_strategy(foundry_dir):
    env = {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    cfg = _with("precision", "amp_bf16")
    cfg["fsdp_config"]["activation_checkpointing"] = True
    cfg["dist_timeout"] = 120
    out = composed(translate(cfg, env))
    assert out.strategy._target_ == "llmfoundry.distributed.FSDP"
    assert out.strategy.reshard_after_forward and out.strategy.mixed_precision == "bf16"
    assert (out.strategy.activation_checkpointing, out.strategy.timeout_s) == ("full", 120.0)
    cfg["fsdp_config"]["sharding_strategy"] = "SHARD_GRAD_OP"
    cfg["fsdp_config"]["mixed_precision"] = "FULL"
    out = composed(translate(cfg, env))
    assert not out.strategy.reshard_after_forward and out.strategy.mixed_precision is None
    cfg["fsdp_config"]["sharding_strategy"] = "HYBRID_SHARD"
    assert composed(translate(cfg, env)).parallelism.dp_replicate == 2  # 2 nodes of 4
    cfg["fsdp_config"]["sharding_strategy"] = "NO_SHARD"
    assert composed(translate(cfg, env)).strategy._target_ == "llmfoundry.distributed.DDP"


def test_streams_and_labelled_eval_loaders(foundry_dir):
    cfg = base()
    cfg["train_loader"]["dataset"] = {
        "streams": {
            "web": {"remote": "s3://b/web", "local": "/tmp/web", "proportion": 0.75},
            "code": {"local": "./code", "split": "train", "proportion": 0.25},
        },
        "shuffle": True,
        "num_canonical_nodes": 4,
        "shuffle_block_size": 1000,
        "predownload": 64,
        "shuffle_algo": "py1e",
    }
    own = {"local": "./my-mds", "split": "val"}
    val_streams = copy.deepcopy(cfg["train_loader"]["dataset"]["streams"])
    del val_streams["code"]["split"]  # the streams' split: the loader's (train, val)
    cfg["eval_loader"] = None
    cfg["eval_loaders"] = [
        {
            "label": "c4",
            "name": "text",
            "dataset": {**cfg["train_loader"]["dataset"], "streams": val_streams, "split": "val"},
        },
        {"label": "mine", "name": "text", "dataset": own},
    ]
    native = translate(cfg, {})
    out = composed(native)
    assert OmegaConf.to_container(out.data.streams) == {
        "web": {"remote": "s3://b/web", "local": "/tmp/web", "proportion": 0.75},
        "code": {"remote": "./code", "proportion": 0.25},
    }
    assert out.data.remote is None and out.data.eval_split == "val"
    assert (out.data.canonical_nodes, out.data.shuffle_block_size, out.data.predownload) == (
        4,
        1000,
        64,
    )
    assert OmegaConf.to_container(out.data.eval_datasets) == {"mine": {"remote": "./my-mds"}}
    assert any(n.startswith("train_loader.dataset.shuffle_algo") for n in native.notes)


def test_their_finetuning_jsonl_becomes_instruction_rows_made_before_the_run(foundry_dir):
    lines = [f'{{"prompt": "say {i}", "response": "the number {i}"}}' for i in range(20)]
    (foundry_dir / "sft.jsonl").write_text("\n".join(lines) + "\n")
    cfg = base()
    cfg["tokenizer"]["name"] = str(FIXTURES / "tokenizer")
    cfg["train_loader"] = {
        "name": "finetuning",
        "dataset": {
            "hf_name": "json",
            "hf_kwargs": {"data_files": {"train": "sft.jsonl"}},
            "split": "train",
            "max_seq_len": 32,
            "decoder_only_format": True,
            "allow_pad_trimming": False,
            "packing_ratio": None,
            "shuffle": True,
        },
    }
    cfg["eval_loader"] = None
    native = translate(cfg, {}, prep_root="prepared")
    (step,) = native.prep
    assert (step.kind, step.source) == ("instructions", str(foundry_dir / "sft.jsonl"))
    assert "--no-pack" in describe(step) and "--seq-len 32" in describe(step)
    out = composed(native)
    assert out.data._target_ == "llmfoundry.data.StreamingTextDataset"
    assert (out.data.remote, out.data.eval_split) == (step.target, None)
    assert step.target.startswith("prepared/instructions-")
    make(step)
    meta = json.loads((foundry_dir / step.target / "meta.json").read_text())
    assert meta["seq_len"] == 32 and not meta["packed"] and meta["examples"] == 20
    hub = copy.deepcopy(cfg)
    hub["train_loader"]["dataset"].update(hf_name="mosaicml/dolly_hhrlhf", hf_kwargs={})
    with pytest.raises(UserError, match="train_loader.dataset.hf_name: 'mosaicml/dolly_hhrlhf'"):
        translate(hub, {})


def test_hf_causal_lm_folder_is_imported_and_trained_from(foundry_dir):
    """llm-foundry's own HF export (fixtures: MPTForCausalLM with auto_map) as hf_causal_lm:
    imported before the run, which then starts from its weights with its model config."""
    folder = FIXTURES / "learned-pos" / "hf-ba4"
    cfg = base()
    cfg["model"] = {"name": "hf_causal_lm", "pretrained_model_name_or_path": str(folder)}
    native = translate(cfg, {}, prep_root="prepared")
    (step,) = native.prep
    assert (step.kind, step.source, native.groups["model"]) == (
        "import_hf",
        str(folder),
        "from_checkpoint",
    )
    assert describe(step) == f"python scripts/import_hf.py {folder} {step.target}"
    make(step)
    out = composed(native)  # model=from_checkpoint reads the imported checkpoint's config
    model = OmegaConf.to_container(out, resolve=True)["model"]
    assert (model["d_model"], model["alibi"], model["learned_pos_emb"]) == (32, False, True)
    assert out.load_path == step.target and "optimizer" in out.load_ignore_keys
    make(step)  # a second launch reuses the import
    # The published finetuning recipes' config_overrides: kernel switches, a shorter context.
    cfg["model"]["config_overrides"] = {
        "max_seq_len": 16,
        "attn_config": {"attn_impl": "flash", "attn_uses_sequence_id": False},
    }
    cfg["load_weights_only"] = True  # without load_path: nothing more is loaded
    notes = translate(cfg, {}, prep_root="prepared").notes
    assert any("config_overrides.max_seq_len: rows are max_seq_len long" in n for n in notes)
    cfg["model"]["config_overrides"]["max_seq_len"] = 64
    with pytest.raises(UserError, match="model.config_overrides.max_seq_len: 64: the folder's"):
        translate(cfg, {})
    (foundry_dir / "gpt2").mkdir()
    (foundry_dir / "gpt2" / "config.json").write_text('{"model_type": "gpt2"}')
    for name, message in [
        ("meta-llama/Llama-3.1-8B", "model.pretrained_model_name_or_path: 'meta-llama"),
        ("gpt2", "model.pretrained_model_name_or_path: .*model_type 'gpt2' is not supported"),
    ]:
        cfg["model"]["pretrained_model_name_or_path"] = name
        with pytest.raises(UserError, match=message):
            translate(cfg, {})


def test_hf_causal_lm_not_pretrained_trains_the_folders_architecture_from_our_init(foundry_dir):
    """pretrain/hf-llama-3.1-8B.yaml's way (pretrained: false): config.json alone."""
    folder = foundry_dir / "llama"
    folder.mkdir()
    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    heads = {"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320}
    config = {"model_type": "llama", **sizes, **heads, "max_position_embeddings": 64}
    (folder / "config.json").write_text(json.dumps(config))
    cfg = base()
    cfg["model"] = {"name": "hf_causal_lm", "pretrained_model_name_or_path": "llama"}
    cfg["model"]["pretrained"] = False
    native = translate(cfg, {})
    assert not native.prep and native.groups["model"] == "llama-tiny"
    out = composed(native)
    assert out.model._target_ == "llmfoundry.models.llama.LlamaConfig"
    assert (out.model.d_model, out.model.n_kv_heads, out.model.ffn_hidden_size) == (32, 2, 64)
    assert (out.model.max_seq_len, out.model.vocab_size, out.model.n_layers) == (64, 320, 2)
    cfg["model"]["pretrained_model_name_or_path"] = str(FIXTURES / "alibi" / "hf-ba4")
    out = composed(translate(cfg, {}))  # llm-foundry's own MPT export, weights not read
    assert out.model._target_ == "llmfoundry.models.mpt.MPTConfig" and out.model.alibi
    qwen3 = foundry_dir / "qwen3"  # a family besides MPT and Llama: its own size option
    qwen3.mkdir()
    (qwen3 / "config.json").write_text(
        json.dumps({**config, "model_type": "qwen3", "head_dim": 16})
    )
    cfg["model"]["pretrained_model_name_or_path"] = "qwen3"
    native = translate(cfg, {})
    assert native.groups["model"] == "qwen3-tiny"
    out = composed(native)
    assert out.model._target_ == "llmfoundry.models.qwen3.Qwen3Config"
    assert (out.model.head_dim, out.model.d_model, out.model.n_kv_heads) == (16, 32, 2)


@pytest.mark.parametrize(
    "model_type, experts, size",
    [
        ("mixtral", "num_local_experts", "mixtral-tiny"),
        ("qwen3_moe", "num_experts", "qwen3-moe-tiny"),
    ],
)
def test_hf_causal_lm_not_pretrained_takes_a_mixture_of_experts_architecture(
    foundry_dir, model_type, experts, size
):
    """The same for a transformers Mixtral or Qwen3-MoE folder: its family's size, its numbers."""
    folder = foundry_dir / model_type
    folder.mkdir()
    width = "intermediate_size" if model_type == "mixtral" else "moe_intermediate_size"
    config = {
        "model_type": model_type,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 320,
        "max_position_embeddings": 64,
        experts: 4,
        "num_experts_per_tok": 2,
        width: 48,
    }
    (folder / "config.json").write_text(json.dumps(config))
    cfg = base()
    cfg["model"] = {"name": "hf_causal_lm", "pretrained_model_name_or_path": model_type}
    cfg["model"]["pretrained"] = False
    native = translate(cfg, {})
    assert native.groups["model"] == size
    out = composed(native)
    assert out.model._target_.endswith(
        "MixtralConfig" if model_type == "mixtral" else "Qwen3MoeConfig"
    )
    assert (out.model.n_experts, out.model.top_k, out.model.expert_hidden) == (4, 2, 48)
    assert (out.model.d_model, out.model.n_layers, out.model.vocab_size) == (32, 2, 320)


def test_from_foundry_writes_an_experiment_that_composes_to_the_same_config(foundry_dir, capsys):
    from_foundry = runpy.run_path(str(ROOT / "scripts" / "from_foundry.py"))["main"]
    conf = foundry_dir / "conf"
    shutil.copytree(CONF, conf)
    out = conf / "experiment" / "from_theirs.yaml"
    assert from_foundry(["foundry.yaml", "model.n_layers=3", "--out", str(out)]) == 0
    assert "+experiment=from_theirs" in capsys.readouterr().out
    assert yaml.safe_load(out.read_text())["model"]["n_layers"] == 3
    native = translate(load("foundry.yaml", ["model.n_layers=3"]), {})
    direct = OmegaConf.to_container(compose_config(conf, native.overrides()))
    via_file = OmegaConf.to_container(compose_config(conf, ["+experiment=from_theirs"]))
    direct.pop("hydra", None), via_file.pop("hydra", None)
    assert via_file == direct
    assert via_file["scheduler"]["composer_lag"] is True  # their lr curve, also when moved over
    with pytest.raises(SystemExit) as exit_:
        from_foundry(["foundry.yaml", "--out", str(out)])
    assert exit_.value.code == 2 and "--overwrite" in capsys.readouterr().err


def test_the_yaml_llm_foundry_ran_for_the_fixtures_translates(tmp_path):
    """tests/fixtures/foundry/alibi/train.yaml, trained by llm-foundry 0.22 itself: its
    inmemory logger is refused by name; without it it composes, its hf_checkpointer ours."""
    paths = [
        f"variables.data_local={FIXTURES / 'mds'}",
        f"tokenizer.name={FIXTURES / 'tokenizer'}",
    ]
    cfg = load(FIXTURES / "alibi" / "train.yaml", paths)
    with pytest.raises(UserError, match="llm-foundry key loggers.inmemory"):
        translate(cfg, {})
    del cfg["loggers"]
    out = composed(translate(cfg, {}))
    assert dict(out.callbacks.hf_checkpointer) == {
        "_target_": "llmfoundry.callbacks.HFCheckpointer",
        "save_folder": "/tmp/foundry-fixture-work/alibi",
        "save_interval": "4ba",
        "precision": "float32",
        "overwrite": True,
        "layout": "foundry",  # what llm-foundry's own callback writes for an mpt_causal_lm
    }
    assert (out.model.alibi, out.model.learned_pos_emb, out.model.vocab_size) == (True, False, 320)
    assert (out.data.remote, out.data.shuffle, out.data.eval_split) == (
        str(FIXTURES / "mds"),
        False,
        None,
    )
    assert (out.eval_interval, out.max_duration, out.optimizer.weight_decay) == ("1ep", "8ba", 1e-5)
    assert (out.scheduler.t_warmup, out.scheduler.composer_lag) == ("2ba", True)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("gqa-rope", dict(rope=True, kv_n_heads=2, alibi=False, learned_pos_emb=False)),
        (
            "variants",
            dict(norm_type="rmsnorm", ffn_type="glu", tie_word_embeddings=False, qk_ln=True),
        ),
    ],
)
def test_the_fixtures_rope_rmsnorm_glu_untied_yamls_compose(case, expected):
    """The YAMLs llm-foundry trained gqa-rope and variants with (its RoPE, RMSNorm, mptglu,
    untied head) compose to our MPT with those options (their logits: test_mpt_foundry_folders)."""
    paths = [
        f"variables.data_local={FIXTURES / 'mds'}",
        f"tokenizer.name={FIXTURES / 'tokenizer'}",
    ]
    cfg = load(FIXTURES / case / "train.yaml", paths)
    del cfg["callbacks"]["hf_checkpointer"], cfg["loggers"], cfg["save_weights_only"]
    model = composed(translate(cfg, {})).model
    assert {key: model[key] for key in expected} == expected


def test_train_script_prints_the_config_their_yaml_became(foundry_dir):
    """With the overrides scripts/launch.py adds to an llm-foundry config: our run_status
    callback by name in their callbacks map, and Hydra's run folder (Hydra's, not theirs)."""
    launched = ["callbacks.run_status.path=s3://b/runs/x/status.json", "hydra.run.dir=runs/x"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts/train.py"), "foundry.yaml",
         "model.n_layers=3", *launched, "--cfg", "job"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert (printed["model"]["n_layers"], printed["run_name"]) == (3, "tiny-foundry")
    assert printed["callbacks"]["run_status"]["_target_"] == "llmfoundry.callbacks.RunStatus"
    assert printed["callbacks"]["run_status"]["path"] == "s3://b/runs/x/status.json"
    # Not secrets, though named with token and key: the printout keeps them.
    assert (printed["tokenizer"], printed["load_ignore_keys"]) == ("./my-mds/tokenizer.json", [])
    assert printed["data"]["remote"] == "./my-mds" and printed["max_duration"] == "4ba"
    assert "llm-foundry fsdp_config: one process trains without FSDP" in result.stderr


def test_readme_block_runs_as_written(foundry_dir, capsys):
    """README "llm-foundry train YAMLs": each command, with our YAML as mpt-small-cpu.yaml and
    conf/ copied (the experiment file goes there): train.py's translation passes the config
    check train.py runs first, from_foundry.py writes the file, +experiment= composes it."""
    from tests.e2e.test_readme_blocks import commands, readme_blocks

    (block,) = [b for b in readme_blocks() if b.head.startswith("python scripts/train.py mpt-")]
    shutil.copy(foundry_dir / "foundry.yaml", foundry_dir / "mpt-small-cpu.yaml")
    shutil.copytree(CONF, foundry_dir / "conf")
    from_foundry = runpy.run_path(str(ROOT / "scripts" / "from_foundry.py"))["main"]
    ran = []
    for program, script, *args in commands(block):
        assert program == "python"
        if script == "scripts/from_foundry.py":
            assert from_foundry(args) == 0
        elif args[0].endswith(".yaml"):
            overrides = [a for a in args[1:] if "=" in a]
            check(foundry_dir / "conf", translate(load(args[0], overrides), {}).overrides())
        else:
            check(foundry_dir / "conf", args)
        ran.append(script)
    assert ran == ["scripts/train.py"] * 2 + ["scripts/from_foundry.py", "scripts/train.py"]
    assert (foundry_dir / "conf" / "experiment" / "mine.yaml").is_file()


def test_their_icl_tasks_become_the_icl_eval_callback_on_every_example(foundry_dir):
    from hydra.utils import instantiate

    from tests.eval.test_icl_eval import word_tokenizer, write

    (foundry_dir / "my-mds" / "tokenizer.json").write_text(word_tokenizer().json)
    (foundry_dir / "data").mkdir()
    write(foundry_dir / "data" / "lm.jsonl", [{"context": "a", "continuation": "b"}] * 3)
    task = {"label": "lm", "dataset_uri": "data/lm.jsonl", "num_fewshot": [0, 1],
            "icl_task_type": "language_modeling", "continuation_delimiter": "\nAnswer: "}  # fmt: skip
    native = translate({**base(), "icl_tasks": [task], "icl_seq_len": 32}, {})
    assert native.groups["callbacks"][-1] == "icl_eval"
    callback = instantiate(composed(native).callbacks.icl_eval)  # through Hydra's overrides
    assert [t.name for t in callback.tasks] == ["lm/0-shot", "lm/1-shot"]
    assert callback.limit is None
    assert callback.tasks[0].options.continuation_delimiter == "\nAnswer: "
    native = translate({**base(), "icl_tasks_str": "tasks.yaml"}, {})
    assert native.get("callbacks.icl_eval.icl_tasks") == "tasks.yaml"
    with pytest.raises(UserError, match="llm-foundry key icl_seq_len: set max_seq_len in each"):
        translate({**base(), "icl_tasks": [task], "icl_seq_len": 16}, {})
