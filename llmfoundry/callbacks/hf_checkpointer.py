"""Write the model as a transformers folder while training: llm-foundry's ``hf_checkpointer``.

Every `save_interval` and when training ends, `{save_folder}/huggingface/ba{N}` (the layout
llm-foundry's callback writes, N the batch) receives what ``scripts/export_hf.py`` writes for a
checkpoint, with the run's tokenizer: in `layout` auto, the family's transformers folder
(``MptForCausalLM``, ``LlamaForCausalLM``: loads without remote code) where that class holds
the model, else (an MPT with biases, learned positions, RoPE, ...) llm-foundry's MPT layout, as
llm-foundry's own callback writes it (less its remote code); `layout: transformers` or
`foundry` insists on one. `save_folder` is a local folder or an fsspec URL.

Whole weights are gathered on every rank (under FSDP a collective: `model_state_dict`, as full
checkpoints gather them), and rank 0 writes. A model the layout cannot hold is refused when
training starts, not at the first save.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

import torch

from llmfoundry.callbacks.checkpoint_saver import SavesEvery
from llmfoundry.checkpoint.pretrained import model_from_weights
from llmfoundry.checkpoint.state import model_state_dict
from llmfoundry.core.engine import Logger
from llmfoundry.core.state import State
from llmfoundry.data.prep.instructions import trained_chat_template
from llmfoundry.distributed import unwrap_model
from llmfoundry.models.families import family_of
from llmfoundry.models.hf_folder import hf_tokenizer
from llmfoundry.utils.errors import UserError
from llmfoundry.utils.files import join_url
from llmfoundry.utils.storage import is_local, local_path, url_to_fs

log = logging.getLogger(__name__)

# llm-foundry's precision names for the exported weights.
PRECISIONS = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def folder_name(batch: int) -> str:
    """Where the export at `batch` goes, under save_folder (llm-foundry's default name)."""
    return f"huggingface/ba{batch}"


class HFCheckpointer(SavesEvery):
    """Args:
    save_folder: local folder or fsspec URL; exports go to ``<save_folder>/huggingface/ba<N>``.
    save_interval: Time string in any unit (``500ba``, ``1ep``); None exports only at the end.
    precision: the exported weights' dtype: float32, float16 or bfloat16.
    overwrite: replace an export folder that exists already (as llm-foundry's default);
        false: such a folder stops the run, naming it.
    layout: auto, transformers or foundry (llm-foundry's MPT layout): see the module docstring.
    """

    def __init__(
        self,
        save_folder: str,
        save_interval: str | None = None,
        precision: str = "float32",
        overwrite: bool = True,
        layout: str = "auto",
    ) -> None:
        if not save_folder:
            raise UserError("hf_checkpointer: save_folder must name a folder or URL to export to")
        if precision not in PRECISIONS:
            raise UserError(
                f"hf_checkpointer: precision {precision!r}: use one of {', '.join(PRECISIONS)}"
            )
        super().__init__(save_interval)
        self.save_folder = save_folder
        self.dtype = PRECISIONS[precision]
        self.overwrite = overwrite
        self.layout = layout
        self.last_saved: str | None = None
        self._saved_batch: int | None = None

    def fit_start(self, state: State, logger: Logger) -> None:
        strategy = state.strategy
        if strategy.saves_own_checkpoints or strategy.pipeline is not None:
            raise UserError(
                "hf_checkpointer: not under DeepSpeed or pipeline parallelism (no whole weights "
                "to gather); save checkpoints and export one: python scripts/export_hf.py CKPT OUT"
            )
        model = unwrap_model(state.model)
        try:
            # what the layout cannot hold, now
            self.layout = family_of(model).export_layout(model.config, self.layout)
        except UserError as err:
            raise UserError(f"hf_checkpointer: {err}") from None
        if not state.config.get("tokenizer"):
            raise UserError("hf_checkpointer: the run has no tokenizer= to put in the folder")

    def save(self, state: State, logger: Logger | None = None) -> None:
        """Export now (once per batch); every rank calls this, rank 0 writes."""
        batch = state.timestamp.batch
        if self._saved_batch == batch:
            return
        self._saved_batch = batch
        weights = model_state_dict(state.model)  # a collective under FSDP: every rank
        if state.rank != 0:
            return
        config = unwrap_model(state.model).config
        model = model_from_weights(config, weights, "the trained model")
        target = join_url(self.save_folder, folder_name(batch))
        tokenizer = hf_tokenizer(
            state.config["tokenizer"], chat_template=trained_chat_template(state.config.get("data"))
        )
        with tempfile.TemporaryDirectory(prefix="hf-export-") as scratch:
            written = Path(scratch, "ba")
            family_of(model).export_to_hf(
                model, written, tokenizer=tokenizer, dtype=self.dtype, layout=self.layout
            )
            self._publish(written, target)
        self.last_saved = target
        log.info("wrote %s folder %s", self.layout, target)

    def _publish(self, written: Path, target: str) -> None:
        """Move the finished folder to `target`, replacing one there only under `overwrite`."""
        if is_local(target):
            path = Path(local_path(target))
            if path.exists():
                self._refuse_existing(target)
                shutil.rmtree(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(written, path)
            return
        fs, remote = url_to_fs(target)
        if fs.exists(remote):
            self._refuse_existing(target)
            fs.rm(remote, recursive=True)
        fs.put(str(written), remote, recursive=True)

    def _refuse_existing(self, target: str) -> None:
        if not self.overwrite:
            raise UserError(
                f"hf_checkpointer: {target} exists already; set overwrite: true to replace it, "
                "or another save_folder"
            )
