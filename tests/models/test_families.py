"""The model-family spec: what build, resume, loading and planning find for each family."""

import dataclasses
import json

import pytest
import torch

from llmfoundry.models import MPTConfig, parallel_plan
from llmfoundry.models.families import (
    FAMILIES,
    build_model,
    config_from_record,
    family_of,
    family_of_hf,
    family_of_target,
)
from llmfoundry.models.llama import LlamaConfig, LlamaForCausalLM


def llama() -> LlamaConfig:
    return LlamaConfig.preset("llama-tiny", init_device="meta")


def test_each_family_is_found_by_config_model_target_and_hf_type(tmp_path):
    for name, family in FAMILIES.items():
        assert family.name == name
        assert family_of_target(family.config_target) is family
        (tmp_path / "config.json").write_text(json.dumps({"model_type": family.hf_model_type}))
        assert family_of_hf(tmp_path) is family
    model = build_model(llama())
    assert isinstance(model, LlamaForCausalLM) and family_of(model) is FAMILIES["llama"]
    assert family_of(MPTConfig(d_model=64, n_heads=2, n_layers=1)) is FAMILIES["mpt"]
    assert family_of_target(None) is FAMILIES["mpt"]  # checkpoints that record no _target_


def test_unknown_families_are_named():
    with pytest.raises(ValueError, match="Linear belongs to no model family"):
        family_of(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="model _target_ 'x.Y' is no model family's config"):
        family_of_target("x.Y")


def test_an_unsupported_hf_folder_names_its_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported; supported: 'mpt'"):
        family_of_hf(tmp_path)


def test_a_recorded_config_comes_back_as_its_family_s_config():
    cfg = llama()
    record = FAMILIES["llama"].recorded_config(cfg)
    assert record["_target_"] == "llmfoundry.models.llama.LlamaConfig"
    assert config_from_record(record, init_device="meta") == cfg
    mpt = MPTConfig(d_model=64, n_heads=2, n_layers=1, compile=True)
    back = config_from_record(FAMILIES["mpt"].recorded_config(mpt))
    assert back.compile is False  # loaded for inference: eager


def test_the_llama_plan_names_its_blocks():
    model = build_model(llama())
    assert parallel_plan(model).blocks == list(model.transformer.blocks)


def test_decoding_asks_the_family_not_mpt_fields_on_every_config():
    from llmfoundry.models.generation import GenerationConfig, generate

    assert not hasattr(LlamaConfig, "infini") and not hasattr(LlamaConfig, "learned_pos_emb")
    cfg = LlamaConfig.preset("llama-tiny", d_model=32, n_layers=1, vocab_size=64, max_seq_len=4)
    out = generate(build_model(cfg), torch.tensor([[1, 2, 3]]), None, GenerationConfig(8, 0))
    assert len(out.tokens[0]) == 8  # RoPE: no position table caps it at max_seq_len
    mpt = build_model(MPTConfig(d_model=32, n_heads=2, n_layers=1, max_seq_len=4, alibi=False))
    with pytest.raises(ValueError, match="more than max_seq_len 4"):
        generate(mpt, torch.tensor([[1, 2, 3]]), None, GenerationConfig(8, 0))


def test_the_attention_window_is_the_family_s():
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "eval_passkey.py"
    window = runpy.run_path(str(script), run_name="eval_passkey")["attention_window"]
    assert window(llama(), 512) == 512  # Llama attends over the whole row
    assert window(MPTConfig(d_model=64, n_heads=2, n_layers=1, sliding_window=32), 512) == 32
    infini = MPTConfig(d_model=64, n_heads=2, n_layers=1, infini={"segment_len": 16})
    assert window(infini, 512) == 16


def family_imports() -> list[str]:
    """Every import of a family package (models/<name>/ with a spec.py) from outside it, in
    llmfoundry, scripts and data_prep, but the registry's (families.py) of each family's spec."""
    import ast
    from pathlib import Path

    import llmfoundry

    package = Path(llmfoundry.__file__).parent
    root = package.parent
    families = {d.name for d in (package / "models").iterdir() if (d / "spec.py").is_file()}
    registry = Path("llmfoundry/models/families.py")
    found = []
    for path in [*package.rglob("*.py"), *root.glob("scripts/*.py"), *root.glob("data_prep/*.py")]:
        relative = path.relative_to(root)
        own = relative.parts[2] if relative.parts[:2] == ("llmfoundry", "models") else None
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            for module in modules:
                parts = module.split(".")
                if parts[:2] != ["llmfoundry", "models"] or len(parts) < 3:
                    continue
                if parts[2] not in families or parts[2] == own:
                    continue
                if relative == registry and parts[3:] == ["spec"]:
                    continue
                found.append(f"{relative}:{node.lineno} imports {module}")
    return found


def test_only_the_registry_imports_a_family():
    """A family imports only itself and the shared pieces (models/layers, generation, norms,
    hf_folder, ...); the rest of the code reaches a family through the registry's spec."""
    assert len(FAMILIES) >= 2
    violations = family_imports()
    assert not violations, "\n".join(violations)


def test_a_family_whose_config_subclasses_another_s_is_its_own(monkeypatch):
    """A Llama variant (its config a LlamaConfig subclass, its model Llama's class) registered
    after Llama is found as itself, not as Llama: by config, by model, for the build and the
    plan. The lookup was isinstance in dict order, which returned Llama."""

    @dataclasses.dataclass
    class VariantConfig(LlamaConfig):
        pass

    variant = dataclasses.replace(FAMILIES["llama"], name="variant", config_class=VariantConfig)
    monkeypatch.setitem(FAMILIES, "variant", variant)
    config = VariantConfig(**dataclasses.asdict(llama()))
    model = build_model(config)
    assert family_of(config) is variant and family_of(model) is variant
    assert family_of(llama()) is FAMILIES["llama"]
    assert family_of(build_model(llama())) is FAMILIES["llama"]
    plan = variant.parallelize(model)
    planned = dataclasses.replace(variant, parallelize=lambda m: m is model and plan)
    monkeypatch.setitem(FAMILIES, "variant", planned)
    assert parallel_plan(model) is plan
