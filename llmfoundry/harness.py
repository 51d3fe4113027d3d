"""lm-evaluation-harness over our model in this process (no server):
``lm_eval --model llmfoundry --model_args checkpoint=PATH --tasks ...``.

`FoundryLM` is an lm-eval model (`TemplateLM`, the base of its transformers model HFLM) whose
three requests run on llmfoundry/eval/scoring.py, the scorer every evaluation here shares:
- ``loglikelihood``: lm-eval's own `TemplateLM.loglikelihood` tokenizes each (context,
  continuation) pair as HFLM does (trailing context whitespace moved to the continuation, the
  whole encoded and split at the context's length; an empty context conditions on BOS, else
  EOS), then `score_continuations` gives the summed log-probability and whether every token is
  the greedy one;
- ``loglikelihood_rolling``: HFLM's windows (lm-eval's `get_rolling_token_windows` and
  `make_disjoint_window`, `max_seq_len` + 1 tokens each) scored the same way and summed;
- ``generate_until``: `continue_prompts` up to ``max_gen_toks`` new tokens, stopping at EOS or
  once the text holds an ``until`` string, then cut as HFLM cuts (lm-eval's
  `postprocess_generated_text`): greedy, or sampled with ``do_sample`` and a temperature (and
  ``top_k``/``top_p``) as `generation.generate` samples, each prompt's draws seeded by the
  ``seed`` model arg (so they do not depend on the batch, and every rank of a mesh draws alike).
Its scores equal lm-eval's `local-completions` against scripts/serve.py and HFLM's on the
transformers folder scripts/export_hf.py writes (tests/eval/test_harness.py,
tests/serving/test_server.py).

Model args: ``checkpoint`` (anything `load_pretrained` takes: a checkpoint, a save folder, a
Composer checkpoint, a transformers MPT/Llama folder; or, in Python, the model itself),
``tokenizer`` (default: the checkpoint's), ``batch_size``, ``max_seq_len`` (default: the
model's), ``max_gen_toks`` (default 256, as HFLM), ``device`` (lm-eval's CLI passes cuda:0 by
default; without CUDA the model stays on CPU, logged), ``precision`` (fp32, bf16, fp16),
``seed`` (of sampled generation; default 1234, lm-eval's torch seed).
Under torchrun (``torchrun --nproc-per-node N -m llmfoundry.harness ... --model_args
checkpoint=PATH,tp=2``) the model is split over the processes as scripts/eval.py splits it
(llmfoundry/checkpoint/on_mesh.py: ``pp`` stages, ``tp`` ranks, ``cp`` context-parallel ranks,
FSDP over the rest; a sharded checkpoint read in parts) and scored through `mesh_forward`.
Every rank must run every request (a split model needs all ranks in each forward), so every
rank reports itself as rank 0 of 1 (`LM`'s default), lm-eval's way for such launchers: it then
reports results on LOCAL_RANK 0 only (on each node, where there are several).

Registration. lm-eval finds a model by name in its registry. No lm-eval release (0.4.13, nor
the pre-release 0.5.0.dev1) discovers installed plugins; its main branch does (pull request
#4013: the entry-point group ``lm_eval.models``), so pyproject.toml declares
``llmfoundry = "llmfoundry.harness:FoundryLM"`` there and the ``lm_eval`` command will find it
with no flag once that ships. Until then ``python -m llmfoundry.harness`` is the ``lm_eval``
command itself (its exact arguments) with ``llmfoundry`` registered first, as lm-eval
registers its own models (a lazy ``module:class`` entry). Nothing outside this package is
touched: a ``.pth`` hook in site-packages would run on every Python start and cannot be
installed by an editable install.

lm-eval stays optional: importing this module without it is one line saying what to install.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch

from llmfoundry.checkpoint.on_mesh import load_on_mesh
from llmfoundry.checkpoint.pretrained import WEIGHT_DTYPES, load_pretrained
from llmfoundry.core.tokenizer import Tokenizer
from llmfoundry.distributed import unwrap_model
from llmfoundry.eval.forward import mesh_forward
from llmfoundry.eval.icl import check_tokenizer_fits
from llmfoundry.eval.scoring import (
    Continuation,
    Forward,
    ModelForward,
    continue_prompts,
    score_continuations,
)
from llmfoundry.models.generation import GenerationConfig
from llmfoundry.tokenizers.tokenizer import prepare_tokenizer
from llmfoundry.utils.errors import MissingPackage, UserError, exit_on_user_error, split_debug_flag

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.utils import (
        handle_stop_sequences,
        normalize_gen_kwargs,
        postprocess_generated_text,
    )
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError:
    _MISSING = (
        "lm-eval in process needs lm-evaluation-harness 0.4.10 or later: "
        "pip install 'lm_eval>=0.4.10'"
    )
    if __name__ == "__main__":  # python -m llmfoundry.harness: one line, as every script
        print(f"lm_eval: {_MISSING}", file=sys.stderr)
        sys.exit(2)
    raise MissingPackage(_MISSING) from None

__all__ = ["MODEL_NAME", "FoundryLM", "main", "register"]

log = logging.getLogger(__name__)

MODEL_NAME = "llmfoundry"  # --model llmfoundry
# The generation_kwargs understood (after lm-eval's normalize_gen_kwargs); any other is refused
# rather than ignored. top_k and top_p apply to sampling (greedy decoding makes them moot, as in
# transformers' generate).
SETTINGS = {"do_sample", "temperature", "top_p", "top_k", "max_gen_toks"}


def _positive_int(name: str, value: Any) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number <= 0 or str(number) != str(value).strip():
        raise UserError(f"{name}={value!r}: give a positive whole number")
    return number


def _whole_number(name: str, value: Any) -> int:
    try:
        return int(str(value).strip())
    except ValueError:
        raise UserError(f"{name}={value!r}: give a whole number") from None


def _device(requested: str | None) -> torch.device:
    """`requested`, or CPU where it names CUDA and there is none (lm-eval's CLI asks for
    cuda:0 unless told otherwise, as HFLM falls back)."""
    if requested is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise UserError(f"device={requested!r}: not a device (cpu, cuda, cuda:1, ...)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        log.warning("device=%s: no CUDA here, the model runs on CPU", requested)
        return torch.device("cpu")
    return device


def _on_mesh(
    checkpoint: str | torch.nn.Module,
    tp: int,
    pp: int,
    cp: int,
    precision: str,
    device: str | None,
) -> tuple[torch.nn.Module, str | None, Forward]:
    """This rank's part of the checkpoint's model split over torchrun's processes as
    scripts/eval.py splits it (`load_on_mesh`: `pp` stages, `tp` ranks, `cp` context-parallel
    ranks, FSDP over the rest), where its tokenizer is, and the `Forward` every rank runs
    together."""
    if not isinstance(checkpoint, str):
        raise UserError("under torchrun give checkpoint=PATH: each rank loads its own part")
    if precision != "fp32":
        raise UserError(
            f"precision={precision} under torchrun is not supported yet: the split model runs "
            "in its checkpoint's dtype"
        )
    if device is not None:
        log.info(
            "device=%s: under torchrun each rank uses its own (LOCAL_RANK's GPU or CPU)", device
        )
    loaded = load_on_mesh(checkpoint, tp=tp, pp=pp, cp=cp)
    atexit.register(loaded.strategy.teardown)
    return loaded.model, loaded.tokenizer, mesh_forward(loaded.model, loaded.strategy)


class FoundryLM(TemplateLM):
    """An lm-eval model over an llmfoundry model (its model args: the module docstring).
    In Python, `checkpoint` may be the model itself and `tokenizer` a loaded one, and `forward`
    the model's `Forward` where it is not whole on this process (llmfoundry/eval/forward.py)."""

    def __init__(
        self,
        checkpoint: str | torch.nn.Module | None = None,
        tokenizer: str | Tokenizer | None = None,
        batch_size: int | str = 8,
        max_seq_len: int | str | None = None,
        max_gen_toks: int | str = 256,
        device: str | None = None,
        precision: str = "fp32",
        seed: int | str = 1234,
        tp: int | str = 1,
        pp: int | str = 1,
        cp: int | str = 1,
        forward: Forward | None = None,
        **unknown: Any,
    ) -> None:
        super().__init__()
        unknown = {k: v for k, v in unknown.items() if v is not None}  # lm-eval's unset CLI args
        if unknown:
            raise UserError(
                f"unknown model_args {sorted(unknown)}: llmfoundry takes checkpoint, tokenizer, "
                "batch_size, max_seq_len, max_gen_toks, device, precision, seed, tp, pp, cp"
            )
        if checkpoint is None:
            raise UserError("no checkpoint: pass --model_args checkpoint=PATH")
        if precision not in WEIGHT_DTYPES:
            raise UserError(f"precision={precision!r}: choose one of {sorted(WEIGHT_DTYPES)}")
        tp, pp, cp = _positive_int("tp", tp), _positive_int("pp", pp), _positive_int("cp", cp)
        if "RANK" in os.environ and forward is None:  # torchrun's
            model, tokenizer_path, forward = _on_mesh(checkpoint, tp, pp, cp, precision, device)
        elif (tp, pp, cp) != (1, 1, 1):
            raise UserError(
                f"tp={tp} pp={pp} cp={cp} split the model over torchrun's processes: launch with "
                "`torchrun --nproc-per-node N -m llmfoundry.harness ...`"
            )
        else:
            model, tokenizer_path = (
                (checkpoint, None)
                if isinstance(checkpoint, torch.nn.Module)
                else load_pretrained(checkpoint)
            )
            model = model.to(_device(device), WEIGHT_DTYPES[precision]).eval()
        self.model = model
        config = unwrap_model(model).config
        self.tokenizer = self._tokenizer(tokenizer or tokenizer_path, config.vocab_size)
        self.forward = forward or ModelForward(model)
        self.batch_size = _positive_int("batch_size", batch_size)
        self.max_seq_len = _positive_int(
            "max_seq_len", config.max_seq_len if max_seq_len is None else max_seq_len
        )
        self.max_gen_toks = _positive_int("max_gen_toks", max_gen_toks)
        self.seed = _whole_number("seed", seed)

    @staticmethod
    def _tokenizer(spec: str | Tokenizer | None, vocab_size: int) -> Tokenizer:
        if spec is None:
            raise UserError("the checkpoint has no tokenizer: pass --model_args tokenizer=PATH")
        tokenizer = prepare_tokenizer(spec, require_eos=False) if isinstance(spec, str) else spec
        check_tokenizer_fits(tokenizer, vocab_size)
        if tokenizer.eos_id is None and tokenizer.bos_id is None:
            raise UserError(
                "the tokenizer has neither an EOS nor a BOS token, which lm-eval conditions an "
                "empty context on; give one with an EOS token"
            )
        return tokenizer

    @property
    def eot_token_id(self) -> int | None:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context and the first rolling window condition on: BOS, else EOS
        (HFLM's choice)."""
        bos = self.tokenizer.bos_id
        return bos if bos is not None else self.tokenizer.eos_id

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **_: Any
    ) -> list[int]:
        """The tokenizer's ids; unless told otherwise, with what it adds around every input (a
        transformers tokenizer's default, which HFLM keeps)."""
        return self.tokenizer.encode(string, add_special_tokens=add_special_tokens is not False)

    def _loglikelihood_tokens(
        self, requests: Sequence[tuple[Any, list[int], list[int]]], **_: Any
    ) -> list[tuple[float, bool]]:
        """(summed log-probability, all tokens greedy) of each (key, context, continuation)."""
        continuations = [Continuation(context, answer) for _, context, answer in requests]
        scored = score_continuations(self.forward, continuations, self.max_seq_len, self.batch_size)
        results = []
        for (key, _, _), score in zip(requests, scored, strict=True):
            result = (score.logprob, score.greedy)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
            results.append(result)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each text's total log-probability over HFLM's rolling windows."""
        windows, owners = [], []
        for index, request in enumerate(requests):
            (text,) = request.args
            for context, answer in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_seq_len,
                    context_len=1,
                ),
            ):
                windows.append((None, context, answer))
                owners.append(index)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[index] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut at the first `until` string; requests that share their
        generation settings are batched together."""
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(index)
        texts: list[str] = [""] * len(requests)
        for indices in groups.values():
            settings = requests[indices[0]].args[1]
            contexts = [requests[i].args[0] for i in indices]
            for i, text in zip(indices, self._generate(contexts, settings), strict=True):
                texts[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return texts

    def _generate(self, contexts: list[str], settings: dict[str, Any]) -> list[str]:
        """The continuation texts of `contexts` under one task's generation settings."""
        kwargs = normalize_gen_kwargs(settings, self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=None)
        unsupported = set(kwargs) - SETTINGS
        if unsupported:
            raise UserError(f"generation_kwargs {sorted(unsupported)} are not supported here")
        temperature = float(kwargs.get("temperature", 0.0)) if kwargs["do_sample"] else 0.0
        if kwargs["do_sample"] and temperature == 0.0:
            raise UserError(
                "generation_kwargs do_sample: true with temperature 0: give a temperature above 0 "
                "(or do_sample: false for greedy)"
            )
        config = GenerationConfig(
            max_new_tokens=kwargs["max_gen_toks"],
            temperature=temperature,
            top_k=kwargs.get("top_k") if temperature else None,
            top_p=kwargs.get("top_p") if temperature else None,
            eos_token_id=self.tokenizer.eos_id,
            seed=self.seed,
        )
        stops = [term for term in until if term]

        def stop(new: list[int]) -> bool:
            return any(term in self.tokenizer.decode(new) for term in stops)

        prompts = [self.tok_encode(context) for context in contexts]
        new = continue_prompts(
            self.forward,
            prompts,
            config,
            self.max_seq_len,
            stop if stops else None,
            self.batch_size,
        )
        return [postprocess_generated_text(self.tokenizer.decode(t), until, None) for t in new]


def register() -> None:
    """Make ``llmfoundry`` a model name lm-eval knows in this process (see Registration above):
    a lazy entry, as lm-eval registers its own, after those (its registry imports its models
    only while empty)."""
    import lm_eval.models  # noqa: F401
    from lm_eval.api.registry import model_registry

    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target="llmfoundry.harness:FoundryLM")


def main(argv: list[str] | None = None) -> None:
    """The ``lm_eval`` command with ``--model llmfoundry`` known; problems with our model's
    settings end as one line and exit status 2 (``--debug``: the traceback)."""
    from lm_eval.__main__ import cli_evaluate

    register()
    args, debug = split_debug_flag(sys.argv[1:] if argv is None else argv)
    sys.argv = [sys.argv[0], *args]  # lm-eval's CLI reads sys.argv
    with exit_on_user_error(debug, prefix="lm_eval"):
        cli_evaluate()


if __name__ == "__main__":
    main()
