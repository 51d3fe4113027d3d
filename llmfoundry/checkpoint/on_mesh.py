"""A trained model split over torchrun's processes as training splits it, to evaluate a model
too large for one process in place (scripts/eval.py under torchrun).

`load_on_mesh(path, tp, pp, cp)` lays the processes out as `strategy=fsdp` does: `pp` pipeline
stages, `tp` tensor-parallel ranks, `cp` context-parallel ranks (each sequence split over them,
llmfoundry/distributed/context.py), FSDP over the rest (the FSDP strategy itself, so the model
is split exactly as in training). Each rank builds the model of the checkpoint's recorded config
(as `model=from_checkpoint` takes it) on the meta device, and the strategy materializes its
part. The weights then come:

- from our sharded checkpoint's DCP shards (``sharded/``), through torch.distributed.checkpoint:
  each rank reads only the saved chunks that overlap what it now holds (DCP reshards from the
  saving run's layout to this mesh), so no process ever holds the whole weights. What each rank
  read is logged (the largest share of the checkpoint's weights any rank read);
- from any other checkpoint (``model.safetensors``, Composer's, a transformers folder) whole, on
  every rank (`read_pretrained`), of which each rank keeps its part: for a while every rank
  holds the whole model, as one process would.

Every refusal a user can fix (a world the mesh does not divide, a tp the heads do not divide, a
pp beyond the blocks, a cp the model cannot take) comes on every rank alike before any process
waits on another.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from llmfoundry.checkpoint.catalogue import SHARDED_DIR
from llmfoundry.checkpoint.formats import OurFormat, locate, read_run_together
from llmfoundry.checkpoint.ours import checkpoint_tokenizer, model_config
from llmfoundry.checkpoint.pretrained import Pretrained, is_hf_folder, read_pretrained
from llmfoundry.checkpoint.reader import read_state
from llmfoundry.checkpoint.sharded import DCP_METADATA, load_model_shards
from llmfoundry.checkpoint.state import load_model_state_dict
from llmfoundry.distributed import FSDP
from llmfoundry.distributed.context import check_context_parallel
from llmfoundry.distributed.parallelize import check_tensor_parallel
from llmfoundry.distributed.pipeline import check_pipeline_split
from llmfoundry.models import parallel_plan
from llmfoundry.models.families import build_model
from llmfoundry.utils import storage
from llmfoundry.utils.errors import UserError
from llmfoundry.utils.files import join_url

__all__ = ["OnMesh", "load_on_mesh"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OnMesh:
    """This rank's part of the model (eval mode), the strategy that split it (its process group
    joined: `strategy.teardown()` leaves it) and where the tokenizer is (None: unknown)."""

    model: nn.Module
    strategy: FSDP
    tokenizer: str | None


def load_on_mesh(path: str, tp: int = 1, pp: int = 1, cp: int = 1, device: str = "auto") -> OnMesh:
    """The model at `path` (a checkpoint, save folder or transformers folder, as
    `load_pretrained` takes it) split over this torchrun job's processes: `pp` stages, `tp`
    tensor-parallel ranks, `cp` context-parallel ranks, FSDP over the rest (module docstring).
    Every rank calls it."""
    _check_world(tp, pp, cp)
    strategy = FSDP(device=device, parallelism={"tp": tp, "pp": pp, "cp": cp})
    shards = _dcp_checkpoint(path)
    whole = None
    if shards is not None:  # the run state alone: the weights stay in the shards
        state = read_state(shards)
        config, tokenizer = model_config(state, shards), checkpoint_tokenizer(shards, state)
        model = build_model(config, init_device="meta")
    else:
        whole = read_pretrained(path)
        config, tokenizer = whole.model.config, whole.tokenizer
        model = build_model(config, init_device="meta").to(_dtype_of(whole.model))
    _check_mesh(model, tp, pp, cp)
    strategy.setup()
    try:
        if shards is not None:  # every file checked against the manifest, shared out
            read_run_together(shards, strategy.rank)
        model = strategy.prepare(model)
        if whole is None:
            _load_shards(shards, model, strategy)
        else:
            _load_whole(whole, model, strategy)
    except BaseException:
        strategy.teardown()
        raise
    model.config = config  # (built on meta; its weights are real now)
    return OnMesh(model.eval(), strategy, tokenizer)


def _dcp_checkpoint(path: str) -> str | None:
    """The checkpoint folder `path` names when it is ours and keeps its weights in DCP shards;
    None for any other (read whole)."""
    if is_hf_folder(path):
        return None
    located = locate(path)
    if not isinstance(located.format, OurFormat):
        return None
    metadata = join_url(located.location, SHARDED_DIR, DCP_METADATA)
    fs, root = storage.url_to_fs(metadata)
    return located.location if fs.exists(root) else None


def _dtype_of(model: nn.Module) -> torch.dtype:
    """The dtype of `model`'s weights as loaded (one process evaluates in it: so does the
    mesh), or float32 where they mix dtypes."""
    dtypes = {p.dtype for p in model.parameters()}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


def _check_world(tp: int, pp: int, cp: int) -> None:
    """A world the mesh does not divide, refused in the terms of `load_on_mesh` (the strategy's
    own refusal names training's settings)."""
    world, split = int(os.environ.get("WORLD_SIZE", "1")), tp * pp * cp
    if min(tp, pp, cp) >= 1 and world % split:
        raise UserError(
            f"tp={tp} x pp={pp} x cp={cp} = {split} does not divide the {world} processes: "
            f"launch a multiple of {split} (torchrun --nproc-per-node)"
        )


def _check_mesh(model: nn.Module, tp: int, pp: int, cp: int) -> None:
    """What the model cannot be split by, refused before the ranks join (the strategy would
    refuse it too, after)."""
    plan = parallel_plan(model)
    if tp > 1:
        check_tensor_parallel(plan, tp, setting="tp")
    if cp > 1:
        check_context_parallel(plan, cp, setting="cp")
    check_pipeline_split(plan, pp, setting="pp", name=type(model).__name__)


def _load_whole(whole: Pretrained, model: nn.Module, strategy: FSDP) -> None:
    """This rank's part of the weights of `whole` (read whole on every rank)."""
    load_model_state_dict(strategy, model, whole.model.state_dict())
    dims = strategy.dims
    log.info(
        "the checkpoint has no shards: every rank read its weights whole, then kept its part "
        "(pp=%d x fsdp=%d x tp=%d)",
        dims.pp, dims.dp_shard, dims.tp,
    )  # fmt: skip


def _load_shards(checkpoint: str, model: nn.Module, strategy: FSDP) -> None:
    """This rank's part of the weights from the shards; logs the largest share of the
    checkpoint's weights any rank read."""
    try:
        read, total = load_model_shards(join_url(checkpoint, SHARDED_DIR), model)
    except (RuntimeError, ValueError, KeyError) as err:
        raise UserError(
            f"checkpoint {checkpoint!r}: its shards do not fit the model config it records "
            f"({str(err)[:300]}); it was written by another program, or damaged"
        ) from None
    largest = torch.tensor([read], dtype=torch.float64, device=strategy.device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    dims = strategy.dims
    log.info(
        "%s: each rank read at most %.1f%% of the %d bytes of weights in its shard files "
        "(pp=%d x fsdp=%d x tp=%d)",
        checkpoint, 100 * float(largest) / total, total, dims.pp, dims.dp_shard, dims.tp,
    )  # fmt: skip
