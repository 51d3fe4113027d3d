"""Generate text from prompts, to see what the model has learned (at fit end by default)."""

from __future__ import annotations

import logging

from torch import nn

from llmfoundry.core.engine import Callback, Logger
from llmfoundry.core.state import State
from llmfoundry.core.tokenizer import Tokenizer
from llmfoundry.distributed import unwrap_model
from llmfoundry.models.families import find_family
from llmfoundry.models.generation import (
    GenerationConfig,
    generate,
    generate_by_recompute,
    left_pad,
)
from llmfoundry.tokenizers.tokenizer import prepare_tokenizer
from llmfoundry.utils.errors import MissingInput, UserError

log = logging.getLogger(__name__)


class Generate(Callback):
    """At fit end, continue each prompt (one left-padded batch, `generation.generate`).

    Each prompt's samples come from a generator seeded with `seed`, so they are reproducible and
    leave the training RNG untouched. Every rank generates (a sharded model needs all of them);
    the samples are logged once, by rank 0. `tokenizer`: a tokenizer.json path or URL (the
    config's), or any `Tokenizer`.
    """

    runs_the_model = True
    skipped_on_mesh = True  # in the default config: samples are a look, not a result

    def __init__(
        self,
        tokenizer: str | Tokenizer,
        prompts: list[str],
        max_new_tokens: int = 64,
        temperature: float = 0.8,
        top_k: int | None = 40,
        seed: int = 0,
    ) -> None:
        self.tokenizer = tokenizer if isinstance(tokenizer, Tokenizer) else _load(tokenizer)
        self.prompts = list(prompts)
        self.config = GenerationConfig(
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed
        )

    def fit_end(self, state: State, logger: Logger) -> None:
        model = unwrap_model(state.model)
        if find_family(model) is None:
            self._recompute(model)
            return
        ids, mask = left_pad([self.tokenizer.encode(p) for p in self.prompts])
        out = generate(model, ids, mask, self.config, decode=self.tokenizer.decode)
        for prompt, text in zip(self.prompts, out.texts, strict=True):
            log.info("--- sample (prompt %r) ---\n%s", prompt, prompt + text)

    def _recompute(self, model: nn.Module) -> None:
        """A module of your own: each prompt alone, without a KV cache."""
        for prompt in self.prompts:
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


def _load(tokenizer: str) -> Tokenizer:
    """The tokenizer at `tokenizer`; a missing or unreadable file is a one-line error."""
    try:
        return prepare_tokenizer(tokenizer, require_eos=False)  # sampling stops at the length
    except FileNotFoundError:
        raise MissingInput(
            f"tokenizer file {tokenizer!r} not found: data_prep/tokens_to_mds.py writes "
            "tokenizer.json next to the shards; set tokenizer=<path to tokenizer.json>, or "
            "leave out the samples with "
            "callbacks=[speed_monitor,lr_monitor,runtime_estimator,nan_detector,run_status]"
        ) from None
    except Exception as err:  # the tokenizers library raises plain Exceptions on bad files
        raise UserError(
            f"tokenizer={tokenizer!r} is not a readable tokenizer ({err}); point tokenizer= "
            "at the tokenizer.json data_prep wrote next to the shards"
        ) from err
