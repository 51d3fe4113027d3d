"""Our checkpoint's model, whole in one process: its weights (model.safetensors, or sharded/
merged here), the model config its run recorded (`config.model` in state.pt, whose
``_target_`` names the family) and its tokenizer (its own tokenizer.json, or its run's
`tokenizer` setting). The format's `read_model` (formats.py); the run state is reader.py's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmfoundry.checkpoint.catalogue import MODEL_FILE, SHARDED_DIR, STATE_FILE
from llmfoundry.checkpoint.loaded import SavedModel
from llmfoundry.checkpoint.reader import read_checkpoint, read_state
from llmfoundry.checkpoint.sharded import full_model_state
from llmfoundry.models.families import config_from_record
from llmfoundry.tokenizers.tokenizer import tokenizer_exists
from llmfoundry.utils.errors import UserError
from llmfoundry.utils.files import join_url
from llmfoundry.utils.storage import url_to_fs

TOKENIZER_FILE = "tokenizer.json"


def read_model(location: str) -> SavedModel:
    """The model of our checkpoint at `location`, whole, in this process."""
    checkpoint = read_checkpoint(location, rank=0)
    config = model_config(checkpoint.state, checkpoint.path)
    weights = checkpoint.model
    if weights is None:  # sharded: every rank's shards, merged here
        weights = full_model_state(join_url(checkpoint.path, SHARDED_DIR))
    recorded = checkpoint.state.get("config") or {}
    run_name = recorded.get("run_name")
    return SavedModel(
        weights=weights,
        config=config,
        tokenizer=checkpoint_tokenizer(checkpoint.path, checkpoint.state),
        run_name=run_name if isinstance(run_name, str) else None,
        recorded=recorded,
    )


def model_fields(location: str) -> dict[str, Any]:
    """The model config our checkpoint at `location` recorded, as conf/model writes one
    (``_target_`` and fields): `model=from_checkpoint` trains, finetunes or evaluates it
    without retyping its sizes. Reads the run state only, not the weights."""
    state = read_state(location)
    fields = (state.get("config") or {}).get("model")
    if not isinstance(fields, Mapping):
        raise UserError(
            f"checkpoint {location!r} does not record its model config (config.model in "
            f"{STATE_FILE}), so model=from_checkpoint cannot take it; choose a model=<size>"
        )
    return dict(fields)


def model_config(state: Mapping[str, Any], where: str) -> Any:
    """The model config a checkpoint's run recorded (`config.model` of state.pt), for CPU,
    eager; its ``_target_`` names the family (none recorded: MPT, as before families)."""
    fields = (state.get("config") or {}).get("model")
    if not isinstance(fields, Mapping):
        raise UserError(
            f"checkpoint {where!r} does not record its model config (config.model in "
            f"{STATE_FILE}); it was not written by scripts/train.py or scripts/import_hf.py"
        )
    if "fsdp_blocks" in fields:  # conf/model/custom.yaml's: a module of the user's own
        raise UserError(
            f"checkpoint {where!r} holds your own module ({fields.get('_target_')}); scripts "
            "build only the model families from a checkpoint (its file names no code to run): "
            f"build your module and load its {MODEL_FILE} (safetensors.torch.load_file) into it "
            "in Python (sharded: scripts/convert_checkpoint.py writes one)"
        )
    try:
        return config_from_record(fields, init_device="cpu")
    except ValueError as err:
        raise UserError(f"checkpoint {where!r}: {err}") from None


def checkpoint_tokenizer(path: str, state: Mapping[str, Any]) -> str | None:
    own = join_url(path, TOKENIZER_FILE)
    if url_to_fs(own)[0].exists(own):
        return own
    recorded = (state.get("config") or {}).get("tokenizer")
    return recorded if isinstance(recorded, str) and tokenizer_exists(recorded) else None
