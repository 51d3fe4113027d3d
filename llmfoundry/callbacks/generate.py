"""Generate text from prompts, to see what the model has learned (at fit end by default)."""

from __future__ import annotations

import logging

import torch

from llmfoundry.data.prep.tokenizer import load_tokenizer
from llmfoundry.distributed import unwrap_model
from llmfoundry.trainer.engine import Callback, Logger
from llmfoundry.trainer.state import State
from llmfoundry.utils.errors import MissingInput, UserError

log = logging.getLogger(__name__)


class Generate(Callback):
    def __init__(
        self,
        tokenizer: str,
        prompts: list[str],
        max_new_tokens: int = 64,
        temperature: float = 0.8,
        top_k: int | None = 40,
        seed: int = 0,
    ) -> None:
        try:
            self.tokenizer = load_tokenizer(tokenizer)
        except FileNotFoundError:
            raise MissingInput(
                f"tokenizer file {tokenizer!r} not found: data_prep/tokens_to_mds.py writes "
                "tokenizer.json next to the shards; set tokenizer=<path to tokenizer.json>, or "
                "leave out the samples with "
                "callbacks=[speed_monitor,lr_monitor,runtime_estimator,nan_detector]"
            ) from None
        except Exception as err:  # the tokenizers library raises plain Exceptions on bad files
            raise UserError(
                f"tokenizer={tokenizer!r} is not a readable tokenizer ({err}); point tokenizer= "
                "at the tokenizer.json data_prep wrote next to the shards"
            ) from err
        self.prompts = list(prompts)
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_k = top_k
        self.seed = seed

    @torch.no_grad()
    def fit_end(self, state: State, logger: Logger) -> None:
        model = unwrap_model(state.model)
        model.eval()
        rng_state = torch.random.get_rng_state()
        torch.manual_seed(self.seed)
        try:
            for prompt in self.prompts:
                ids = torch.tensor([self.tokenizer.encode(prompt).ids], device=state.device)
                out = model.generate(
                    ids, self.max_new_tokens, temperature=self.temperature, top_k=self.top_k
                )
                text = self.tokenizer.decode(out[0].tolist())
                log.info("--- sample (prompt %r) ---\n%s", prompt, text)
        finally:
            torch.random.set_rng_state(rng_state)
            model.train()
