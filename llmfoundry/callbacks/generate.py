"""Generate text from prompts, to see what the model has learned (at fit end by default)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from llmfoundry.core.engine import Callback, Logger
from llmfoundry.core.loss import IGNORE_INDEX
from llmfoundry.core.state import State
from llmfoundry.core.tokenizer import Tokenizer
from llmfoundry.data.meta import made_without_tokenizer
from llmfoundry.distributed import unwrap_model
from llmfoundry.eval.forward import mesh_forward, splits_the_model
from llmfoundry.eval.scoring import continue_prompts
from llmfoundry.models.families import find_family
from llmfoundry.models.generation import (
    GREEDY_BELOW,
    GenerationConfig,
    generate,
    generate_by_recompute,
    left_pad,
)
from llmfoundry.tokenizers.tokenizer import prepare_tokenizer
from llmfoundry.utils.errors import MissingInput, UserError
from llmfoundry.utils.logs import SAME_ON_EVERY_RANK

log = logging.getLogger(__name__)


FALLBACK_PROMPTS = ["def "]  # when no validation batch was seen (the demo's data is code)


class Generate(Callback):
    """At fit end, continue each prompt (one left-padded batch, `generation.generate`).

    `prompts` None (the default) prompts with the data the model was trained for, so the sample
    says something on Vim docs as on code: the first validation row's untrained prefix when it
    has one (instruction data: the system and user turns and the assistant header, in the
    format it was finetuned in), else the row's first `prompt_tokens` tokens. Rank 0's row is
    used on every rank (a sharded model generates on all ranks in lockstep). Without a
    validation set the prompt is `FALLBACK_PROMPTS`.

    Each prompt's samples come from a generator seeded with `seed`, so they are reproducible and
    leave the training RNG untouched. Every rank generates (a sharded model needs all of them);
    the samples are logged once, by rank 0. `tokenizer`: a tokenizer.json path or URL (the
    config's), or any `Tokenizer`.

    On one process, DDP and FSDP the prompts are decoded with a KV cache; under tensor,
    pipeline or context parallelism (`strategy.tp`, `strategy.pp`, `strategy.cp`), where no
    process holds the whole model or the whole sequence, by recompute through the mesh (llmfoundry/eval/forward.py: `continue_prompts`), the
    same tokens for the same seed. There a seed is required (`seed=null` draws from each
    process's own RNG, and the processes would disagree on the tokens): refused at start.

    A tokenizer file that does not exist is an error when the run starts (`init`), unless the
    training data records that it has none (token files made elsewhere, such as nanoGPT's
    ``train.bin``, whose default ``${data.remote}/tokenizer.json`` is absent): then the samples
    are skipped with one warning saying how to get them, and training goes on.
    """

    def __init__(
        self,
        tokenizer: str | Tokenizer,
        prompts: list[str] | None = None,
        max_new_tokens: int = 64,
        temperature: float = 0.8,
        top_k: int | None = 40,
        seed: int = 0,
        prompt_tokens: int = 16,
    ) -> None:
        if prompts is not None and not prompts:
            raise UserError(
                "callbacks.generate.prompts is empty: list prompts, or set it to null to prompt "
                "with the start of a validation row"
            )
        if prompt_tokens < 1:
            raise UserError(f"callbacks.generate.prompt_tokens={prompt_tokens} must be >= 1")
        # None: the file is missing, which `init` refuses or skips once it knows the data.
        self.tokenizer = tokenizer if isinstance(tokenizer, Tokenizer) else _load(tokenizer)
        self.tokenizer_spec = tokenizer
        self.prompts = None if prompts is None else list(prompts)
        self.prompt_tokens = prompt_tokens
        self._data_prompt: list[int] | None = None  # token ids, from the first validation row
        self.config = GenerationConfig(
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed
        )

    def init(self, state: State, logger: Logger) -> None:
        """A missing tokenizer: skipped with one warning for data made without one, else
        refused (a wrong path), before any training step; so is sampling without a seed on a
        mesh (see the class docstring)."""
        if (
            self.config.seed is None
            and self.config.temperature >= GREEDY_BELOW
            and splits_the_model(state.strategy)
        ):
            raise UserError(
                "callbacks.generate.seed=null under strategy.tp, strategy.pp or strategy.cp: "
                "every process draws the samples, so they need the same seed; set "
                "callbacks.generate.seed"
            )
        if self.tokenizer is not None:
            return
        if not made_without_tokenizer(_training_meta(state)):
            raise MissingInput(
                f"tokenizer file {self.tokenizer_spec!r} not found: data_prep/tokens_to_mds.py "
                "writes tokenizer.json next to the shards; set tokenizer=<path to "
                "tokenizer.json>, or leave out the samples with "
                "callbacks=[speed_monitor,lr_monitor,runtime_estimator,nan_detector,run_status]"
            )
        log.warning(
            "generate: no samples at the end: the training data was made without a tokenizer "
            "and %r does not exist; to get samples, name the tokenizer the tokens came from, "
            "e.g. tokenizer=tiktoken:gpt2 (nanoGPT's), tokenizer=<tokenizer.json or .model>",
            self.tokenizer_spec,
            extra=SAME_ON_EVERY_RANK,
        )

    def eval_batch_start(self, state: State, logger: Logger) -> None:
        if self.tokenizer is None:
            return
        if self.prompts is None and self._data_prompt is None:
            self._data_prompt = row_prompt(state.batch, self.prompt_tokens)

    def fit_end(self, state: State, logger: Logger) -> None:
        if self.tokenizer is None:
            return
        prompts = self._prompts()  # on every rank: rank 0's is broadcast
        model = unwrap_model(state.model)
        if splits_the_model(state.strategy):
            texts = self._on_mesh(state, prompts)
        elif find_family(model) is None:
            self._recompute(model, prompts)
            return
        else:
            ids, mask = left_pad([self.tokenizer.encode(p) for p in prompts])
            with state.precision.autocast():
                out = generate(model, ids, mask, self.config, decode=self.tokenizer.decode)
            texts = out.texts
        for prompt, text in zip(prompts, texts, strict=True):
            log.info("--- sample (prompt %r) ---\n%s", prompt, prompt + text)

    def _on_mesh(self, state: State, prompts: list[str]) -> list[str]:
        """The prompts' samples by recompute through the mesh (nothing cut from the prompts,
        as the KV-cached decoder cuts nothing)."""
        encoded = [self.tokenizer.encode(p) for p in prompts]
        forward = mesh_forward(state.model, state.strategy, state.precision)
        window = max(map(len, encoded)) + self.config.max_new_tokens
        tokens = continue_prompts(forward, encoded, self.config, window)
        return [self.tokenizer.decode(t) for t in tokens]

    def _recompute(self, model: nn.Module, prompts: list[str]) -> None:
        """A module of your own: each prompt alone, without a KV cache."""
        for prompt in prompts:
            tokens = generate_by_recompute(model, self.tokenizer.encode(prompt), self.config)
            if tokens is None:
                log.info(
                    "generate: no samples, %s's forward(batch) returns no logits "
                    "[batch, seq, vocab]",
                    type(model).__name__,
                )
                return
            log.info(
                "--- sample (prompt %r) ---\n%s", prompt, prompt + self.tokenizer.decode(tokens)
            )

    def _prompts(self) -> list[str]:
        """The configured prompts, else rank 0's validation-row prompt, else the fallback."""
        if self.prompts is not None:
            return self.prompts
        ids = self._data_prompt
        if dist.is_available() and dist.is_initialized():
            shared = [ids]
            dist.broadcast_object_list(shared, src=0)
            ids = shared[0]
        if ids is None:
            log.info("generate: no validation batch was seen; prompting %r", FALLBACK_PROMPTS)
            return FALLBACK_PROMPTS
        return [self.tokenizer.decode(ids)]


def row_prompt(batch: dict[str, torch.Tensor] | None, prompt_tokens: int) -> list[int] | None:
    """Token ids prompting like the batch's first row: its untrained prefix when the labels
    have one (instruction rows: everything before the first response token), else its first
    `prompt_tokens` tokens. None for a batch without rows of token ids."""
    if not batch or "input_ids" not in batch or batch["input_ids"].numel() == 0:
        return None
    row = batch["input_ids"][0]
    labels = batch.get("labels")
    if labels is not None and labels.shape == batch["input_ids"].shape:
        trained = (labels[0] != IGNORE_INDEX).nonzero()
        if len(trained) and int(trained[0]) > 0:
            return row[: int(trained[0])].tolist()
    return row[:prompt_tokens].tolist()


def _training_meta(state: State) -> Mapping[str, Any] | None:
    """What data prep recorded about the training data: the builder's loaders hold a dataset
    with its sidecar or meta.json (`meta`); None for any other loader."""
    dataset = getattr(state.train_dataloader, "streaming_dataset", None)
    return getattr(dataset, "meta", None)


def _load(tokenizer: str) -> Tokenizer | None:
    """The tokenizer at `tokenizer`, None where there is no such file; an unreadable one is a
    one-line error."""
    try:
        return prepare_tokenizer(tokenizer, require_eos=False)  # sampling stops at the length
    except FileNotFoundError:
        return None
    except Exception as err:  # the tokenizers library raises plain Exceptions on bad files
        raise UserError(
            f"tokenizer={tokenizer!r} is not a readable tokenizer ({err}); point tokenizer= "
            "at the tokenizer.json data_prep wrote next to the shards"
        ) from err
