"""The GPU acceptance run: does this checkout train, resume, decode, serve and run fast on one GPU?

    bench/gpu_acceptance.sh                           # on the GPU machine (installs .whl/ first)
    bench/gpu_acceptance.sh --only parity,serve       # rerun some phases
    bench/gpu_acceptance.sh --device cpu              # the dry run CI does: tiny shapes, same code

Written for one offline GPU lent for minutes: every phase runs in a process of its own under its
own timeout (and the whole run under --deadline-s), and prints one JSON line, {"phase",
"status": ok | failed | skipped | timeout, "seconds", its numbers}; a summary line ends the run.
The phases, most important first:

  prepare      a token corpus, tokenizer and MDS shards from Python's standard library (CPU)
  cuda_tests   `pytest -m "cuda and not slow"`: the CUDA-gated tests (on CPU: that there are some)
  parity       MPT and Llama x sdpa/flex x with and without document ids: logits, loss and
               gradients in bf16 on the device against fp32 on the CPU, and the attention
               kernel that ran (read from the profiler)
  families     Qwen3 and Qwen3-MoE x sdpa/flex with document ids: parity as above, three bf16
               AdamW steps (two in the dry run), and the MoE's grouped multiply against its
               loop (bf16, forward and backward) with what grouped_mm_runs said
  kv_cache     greedy decoding with the KV cache equals recomputing, and a prompt that joins a
               running batch decodes as it would alone
  fsdp_resume  torchrun FSDP bf16 with async DCP saves and the memory monitor: an uninterrupted
               run against one that stops halfway and resumes (losses after the resume)
  oom          a real out-of-memory error (the process's memory capped) recovered by
               auto-microbatching under FSDP
  serve        scripts/serve.py on fsdp_resume's checkpoint, two concurrent requests
  fp8          mpt-1b (sdpa), compiled blocks, amp_fp8 against amp_bf16 on the same 30 batches
               of 4 x 2048 tokens: loss gap, tokens/s and MFU of both (the compiled row)
  throughput   bench/train_throughput.py --gpu: mpt-125m and mpt-1b x sdpa/flex, eager, MFU
  cuda_compile_tests  `pytest -m "cuda and slow"`: the CUDA-gated tests that compile blocks

The untimed phases run concurrently (serve after fsdp_resume, the data users after prepare);
fp8 and throughput then run alone, so their timings see an idle device, and the compiling tests
last. Results: <out>/results.jsonl and each phase's log in <out>/logs/. Exit status 1 when a
phase failed or timed out.
Hand-written because the phases are processes (torchrun, a server), not tests: pytest would
add nothing but a second layer of capture around them.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STATUSES = ("ok", "failed", "skipped", "timeout")


@dataclass(frozen=True)
class Context:
    """What every phase knows: the device, whether shapes are the dry run's, and the folders."""

    device: str
    work: Path  # data, runs, checkpoints (large; not part of the results)
    logs: Path

    @property
    def tiny(self) -> bool:
        return self.device == "cpu"

    @property
    def data(self) -> Path:
        return self.work / "data"


@dataclass(frozen=True)
class Phase:
    name: str
    run: Callable[[Context], dict]
    gpu_timeout_s: float
    cpu_timeout_s: float
    after: str | None = None  # a phase whose output this one reads
    timed: bool = False  # runs alone, after the others


def python() -> list[str]:
    return [sys.executable]


def torchrun(nproc: int = 1) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
    ]


def sh(cmd: list[str], log: Path) -> int:
    """Run `cmd` in the repository root, appending its output to `log`; its exit status."""
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        done = subprocess.run(
            cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, check=False
        )
    return done.returncode


def checked(cmd: list[str], log: Path) -> None:
    if (rc := sh(cmd, log)) != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {rc} (see {log.name})")


# --------------------------------------------------------------------------- phases


def prepare(ctx: Context) -> dict:
    """Tokens, tokenizer and MDS rows of the longest sequence a later phase reads."""
    import sysconfig

    stdlib = sysconfig.get_paths()["stdlib"]
    sources = [f"{stdlib}/email"] if ctx.tiny else [stdlib]
    log = ctx.logs / "prepare.log"
    ctx.data.mkdir(parents=True, exist_ok=True)
    excludes = ["site-packages", "test", "*/test", "*/tests", "idlelib", "lib2to3"]
    vocab, workers = (4096 if ctx.tiny else 8192), min(8, os.cpu_count() or 1)
    tokens = ctx.data / "tokens.bin"
    checked(
        [*python(), "data_prep/text_to_tokens.py", *sources, "--glob", "*.py"]
        + [arg for pattern in excludes for arg in ("--exclude", pattern)]
        + f"--train-tokenizer --vocab-size {vocab} --workers {workers} --no-progress".split()
        + ["--out", str(tokens)],
        log,
    )
    checked(
        [*python(), "data_prep/tokens_to_mds.py", str(tokens), "--out", str(ctx.data / "mds")]
        + f"--seq-len {seq_len(ctx)} --val-fraction 0.02 --no-progress".split(),
        log,
    )
    meta = json.loads((ctx.data / "tokens.json").read_text())
    return {"status": "ok", "tokens": meta.get("num_tokens") or meta.get("tokens")}


def seq_len(ctx: Context) -> int:
    return 128 if ctx.tiny else 2048


def cuda_tests(ctx: Context, selection: str = "cuda and not slow") -> dict:
    """The CUDA-gated tests (`pytest -m cuda`); on CPU only that the selection is not empty."""
    name = "cuda_tests" if selection == "cuda and not slow" else "cuda_compile_tests"
    log = ctx.logs / f"{name}.log"
    args = ["-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "-m", selection]
    args += cuda_test_files()
    if ctx.tiny:
        args.append("--collect-only")
    rc = sh(python() + args, log)
    tail = log.read_text().strip().splitlines()[-1:]
    counts = _pytest_counts(tail[0] if tail else "")
    ok = rc == 0 and (counts.get("passed", 0) > 0 or (ctx.tiny and counts.get("selected", 0) > 0))
    return {"status": "ok" if ok else "failed", "rc": rc, **counts}


def cuda_test_files() -> list[str]:
    """The test files with CUDA-gated tests: collecting only these needs none of the dev extras
    a GPU image lacks (moto, deepspeed, lm-eval, ...), which other test files import."""
    tests = sorted((ROOT / "tests").rglob("test_*.py"))
    return [str(t.relative_to(ROOT)) for t in tests if "pytest.mark.cuda" in t.read_text()]


def cuda_compile_tests(ctx: Context) -> dict:
    """The CUDA-gated tests that compile the blocks (`-m "cuda and slow"`): minutes of
    compiling, so they run last."""
    return cuda_tests(ctx, "cuda and slow")


def _pytest_counts(summary: str) -> dict[str, int]:
    """'3 passed, 1 skipped in 2.0s' (or '12/900 tests collected') -> {'passed': 3, ...}."""
    words = summary.replace(",", " ").replace("/", " / ").split()
    if words[1:2] == ["/"] and "collected" in words:  # -m with --collect-only: selected/total
        return {"selected": int(words[0]), "collected": int(words[2])}
    return {word: int(n) for n, word in zip(words, words[1:], strict=False) if n.isdigit()}


def _tiny_config(family: str, attn_impl: str):
    from hydra.utils import instantiate

    return instantiate(_tiny_model_node(family), attn_impl=attn_impl)


@functools.cache
def _tiny_model_node(family: str):
    """conf/model/<family>-tiny.yaml, composed once per family and instantiated per model: the
    dry run's parity composed it for each of its 8 models, a quarter of the phase's time."""
    from llmfoundry.config.preflight import compose_config

    name = {
        "mpt": "mpt-tiny",
        "llama": "llama-tiny",
        "qwen3": "qwen3-tiny",
        "qwen3_moe": "qwen3-moe-tiny",
    }[family]
    return compose_config(ROOT / "conf", [f"model={name}"]).model


def _documents(batch: int, length: int, device: str):
    """sequence_id with three documents per row at different cuts."""
    import torch

    sid = torch.zeros(batch, length, dtype=torch.long)
    for row in range(batch):
        sid[row, length // 5 + 3 * row :] = 1
        sid[row, length // 2 + row :] = 2
    return sid.to(device)


def attention_kernels(events) -> list[str]:
    """The attention kernels among profiler events, named as `kernels.kernel_name` names them:
    the SDPA backends' aten ops, and FlexAttention's op or compiled template kernels."""
    names = {
        "aten::_scaled_dot_product_flash_attention": "sdpa:flash",
        "aten::_scaled_dot_product_flash_attention_for_cpu": "sdpa:flash",
        "aten::_scaled_dot_product_efficient_attention": "sdpa:efficient",
        "aten::_scaled_dot_product_cudnn_attention": "sdpa:cudnn",
        "aten::_scaled_dot_product_attention_math": "sdpa:math",
    }
    seen = set()
    for event in events:
        if event.key in names:
            seen.add(names[event.key])
        elif "flex_attention" in event.key.lower() or event.key.startswith("triton_tem_fused"):
            seen.add("flex")
    return sorted(seen)


def _relative_error(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


def parity(ctx: Context) -> dict:
    """bf16 on the device against the fp32 CPU reference (attn_impl=torch), same weights."""

    impls = ["sdpa"] if ctx.tiny else ["sdpa", "flex"]  # flex compiles for minutes on a CPU
    shape = (2, 64) if ctx.tiny else (4, 256)
    cases = [
        _parity_case(ctx.device, family, impl, documents, shape)
        for family in ("mpt", "llama")
        for impl in impls
        for documents in (False, True)
    ]
    # bf16 keeps 8 bits of mantissa: about 1% relative error through a few layers is its due.
    # sdpa's kernel is the one its plan allowed (on CUDA the only one; kernels.kernel_name).
    ok = all(
        c["logits_rel_err"] < 2e-2
        and c["grad_rel_err"] < 3e-2
        and (c["attn_impl"] != "sdpa" or c["kernels"] == c["planned"])
        for c in cases
    )
    return {"status": "ok" if ok else "failed", "cases": cases}


def _parity_case(
    device: str, family: str, impl: str, documents: bool, shape: tuple[int, int]
) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from llmfoundry.models.families import build_model
    from llmfoundry.models.layers.kernels import record_kernels

    torch.manual_seed(0)
    ref = build_model(_tiny_config(family, "torch"))
    fast = build_model(_tiny_config(family, impl))
    fast.load_state_dict(ref.state_dict())
    fast.to(device)
    batch, length = shape
    ids = torch.randint(0, ref.config.vocab_size, (batch, length))
    sid = _documents(batch, length, "cpu") if documents else None
    results = []
    for model, dev, autocast in ((ref, "cpu", False), (fast, device, True)):
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
        with profile(activities=activities) as prof, record_kernels(model) as planned:
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=autocast):
                logits = model(ids.to(dev), None if sid is None else sid.to(dev))
                loss = model.loss(logits, {"labels": ids.to(dev)})
            loss.backward()
        grads = torch.cat([p.grad.flatten().float().cpu() for p in model.parameters()])
        ran = attention_kernels(prof.key_averages())
        results.append((logits.float().cpu(), loss.item(), grads, sorted(set(planned)), ran))
    (ref_logits, ref_loss, ref_grads, *_), (logits, loss, grads, planned, ran) = results
    return {
        "family": family,
        "attn_impl": impl,
        "documents": documents,
        "planned": planned,  # what the model chose (kernels.record_kernels)
        "kernels": ran,  # what the profiler saw run
        "logits_rel_err": _relative_error(logits, ref_logits),
        "loss_abs_err": abs(loss - ref_loss),
        "grad_rel_err": _relative_error(grads, ref_grads),
    }


def families(ctx: Context) -> dict:
    """Qwen3 and Qwen3-MoE (q/k norms, heads wider than d_model / n_heads, MoE layers) as parity
    checks MPT and Llama, with documents, per attention kernel; a few bf16 training steps of
    each; and the MoE's grouped multiply against its loop on the device."""
    impls = ["sdpa"] if ctx.tiny else ["sdpa", "flex"]
    shape = (2, 64) if ctx.tiny else (4, 256)
    pairs = [(family, impl) for family in ("qwen3", "qwen3_moe") for impl in impls]
    cases = [_parity_case(ctx.device, family, impl, True, shape) for family, impl in pairs]
    steps = 2 if ctx.tiny else 3  # a CPU's MoE step takes seconds
    training = [_training_steps(ctx.device, f, impl, shape, steps) for f, impl in pairs]
    experts = _grouped_experts_check(ctx.device)
    # The dense family is held to parity's bounds. In bf16 an MoE's router may pick another
    # expert for a token whose top scores nearly tie, which moves that token's logits: its
    # logits and gradients get twice the room, its mean loss (a few tokens of many) none more.
    ok = (
        all(
            c["logits_rel_err"] < (4e-2 if c["family"] == "qwen3_moe" else 2e-2)
            and c["grad_rel_err"] < (6e-2 if c["family"] == "qwen3_moe" else 3e-2)
            and c["loss_abs_err"] < 1e-2
            and (c["attn_impl"] != "sdpa" or c["kernels"] == c["planned"])
            and (c["attn_impl"] != "flex" or "flex" in c["kernels"])
            for c in cases
        )
        and all(t["grads_finite"] and t["losses"][-1] < t["losses"][0] for t in training)
        and experts["equal"]
    )
    return {"status": "ok" if ok else "failed", "cases": cases, "training": training, **experts}


def _training_steps(
    device: str, family: str, impl: str, shape: tuple[int, int], steps: int
) -> dict:
    """`steps` AdamW steps under bf16 autocast with float32 weights (amp_bf16) on one batch with
    documents: the losses, whether every gradient was finite, and for an MoE whether its experts
    took the grouped multiply."""
    import torch

    from llmfoundry.models.families import build_model
    from llmfoundry.models.layers.moe import GroupedExperts
    from llmfoundry.optim import DecoupledAdamW

    torch.manual_seed(0)
    model = build_model(_tiny_config(family, impl)).to(device)
    optimizer = DecoupledAdamW(model.parameters(), lr=1e-3)
    batch, length = shape
    ids = torch.randint(0, model.config.vocab_size, (batch, length), device=device)
    sid = _documents(batch, length, device)
    losses, finite = [], True
    for _ in range(steps):
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model.loss(model(ids, sid), {"labels": ids})
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        finite = finite and all(bool(torch.isfinite(g).all()) for g in grads)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 4))
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    with torch.autocast(device, dtype=torch.bfloat16):
        x = torch.empty(1, experts[0].w_gate.shape[-1], device=device) if experts else None
        grouped = experts[0]._grouped(x) if experts else None
    return {
        "family": family,
        "attn_impl": impl,
        "losses": losses,
        "grads_finite": finite,
        "experts_grouped": grouped,
    }


def _grouped_experts_check(device: str) -> dict:
    """GroupedExperts' grouped multiply against its loop under bf16 autocast (float32 weights),
    forward and backward, an expert without tokens included: tests/models/test_moe.py's check
    at a real width on this device (whose kernel CPU tests never reach)."""
    import torch

    from llmfoundry.models.layers.moe import GroupedExperts, grouped_mm_runs

    torch.manual_seed(0)
    experts = GroupedExperts(8, 256, 512).to(device)
    counts = torch.tensor([40, 0, 100, 3, 57, 64, 16, 20], device=device)
    x = torch.randn(int(counts.sum()), 256, device=device, requires_grad=True)
    runs = grouped_mm_runs(device, torch.bfloat16)
    with torch.autocast(device, dtype=torch.bfloat16):
        grouped = experts._grouped(x)
    results = []
    for path in (experts.forward, experts.looped):
        with torch.autocast(device, dtype=torch.bfloat16):
            out = path(x, counts)
        out.float().square().sum().backward()
        results.append((out, [p.grad.clone() for p in (x, *experts.parameters())]))
        x.grad = None
        experts.zero_grad()
    (out, grads), (loop_out, loop_grads) = results

    def error(a, b) -> float:  # max error relative to the scale (test_moe.py's _close)
        return float((a.float() - b.float()).abs().max() / b.float().abs().max())

    out_err = error(out, loop_out)
    grad_err = max(error(g, lg) for g, lg in zip(grads, loop_grads, strict=True))
    return {
        "grouped_mm_runs": runs,  # grouped_mm_runs(device, torch.bfloat16)
        "experts_grouped": grouped,
        "experts_out_dtype": str(out.dtype).removeprefix("torch."),
        "experts_rel_err": out_err,
        "experts_grad_rel_err": grad_err,
        "equal": out.dtype == torch.bfloat16 and out_err <= 2e-2 and grad_err <= 2e-2,
    }


def kv_cache(ctx: Context) -> dict:
    """fp32 (TF32 off) greedy decoding: cached against recomputed, and a prompt joining a batch."""
    import torch

    from llmfoundry.models.families import build_model
    from llmfoundry.models.generation import Decoder, GenerationConfig, generate, left_pad

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    config = GenerationConfig(max_new_tokens=12, temperature=0)
    checks = {}
    for family in ("mpt", "llama"):
        torch.manual_seed(0)
        model = build_model(_tiny_config(family, "sdpa")).to(ctx.device).eval()
        vocab = model.config.vocab_size
        prompts = [torch.randint(0, vocab, (n,)).tolist() for n in (5, 9, 12)]
        ids, mask = left_pad(prompts, pad_id=0)
        cached = generate(model, ids, mask, config).tokens
        recomputed = generate(model, ids, mask, config, use_cache=False).tokens
        decoder = Decoder(model, *left_pad(prompts[:2], pad_id=0), configs=config)
        for _ in range(3):
            decoder.step()
        row = decoder.add(prompts[2], config)
        while not decoder.done:
            decoder.step()
        alone = generate(model, torch.tensor([prompts[2]]), None, config).tokens[0]
        checks[family] = {
            "cache_equals_recompute": cached == recomputed,
            "joined_equals_alone": decoder.output().tokens[row] == alone,
        }
    ok = all(all(c.values()) for c in checks.values())
    return {"status": "ok" if ok else "failed", **checks}


def _train_args(ctx: Context, run: str, *extra: str) -> list[str]:
    """scripts/train.py arguments for a short run on the prepared data, in <work>/runs/<run>."""
    folder = ctx.work / "runs" / run
    model = "model=mpt-tiny" if ctx.tiny else "model=mpt-125m"
    return [
        "scripts/train.py",
        model,
        f"data.remote={ctx.data / 'mds'}",
        f"hydra.run.dir={folder}",
        f"save_folder={folder / 'checkpoints'}",
        *f"max_seq_len={seq_len(ctx)} run_name={run} scheduler=constant_with_warmup".split(),
        *"scheduler.t_warmup=2ba eval_first=false loggers=[console,jsonl]".split(),
        "loggers.jsonl.flush_interval=1ba",
        *extra,
    ]


def _metric(ctx: Context, run: str, name: str) -> dict[int, float]:
    """A metric of a run by batch, from its metrics.jsonl (the last value of a re-logged step)."""
    from llmfoundry.loggers.plot import read_metrics

    steps, values = read_metrics(ctx.work / "runs" / run / "metrics.jsonl").get(name, ([], []))
    return dict(zip(steps, values, strict=True))


def fsdp_resume(ctx: Context) -> dict:
    """An uninterrupted run of 2N batches against N batches, then a resume to 2N."""
    # The dry run proves the wiring (torchrun, FSDP, async saves, autoresume) on a few batches of
    # a few rows: its steps are most of its time on a CPU.
    n, batch = (2, 4) if ctx.tiny else (10, 8)
    log = ctx.logs / "fsdp_resume.log"
    common = [
        *f"strategy=fsdp strategy.async_save=true save_interval={n}ba".split(),
        f"global_train_batch_size={batch}",
        "eval_interval=null",
        "callbacks=[speed_monitor,memory_monitor,nan_detector]",
    ]
    if not ctx.tiny:
        common += ["precision=amp_bf16", "strategy.mixed_precision=bf16"]
    whole = _train_args(ctx, "whole", *common, f"max_duration={2 * n}ba")
    half = _train_args(ctx, "half", *common, f"max_duration={n}ba")
    with ThreadPoolExecutor(2) as pool:  # two runs at once: neither is timed
        codes = list(pool.map(lambda a: sh(torchrun() + a, log), [whole, half]))
    resumed = _train_args(ctx, "half", *common, f"max_duration={2 * n}ba", "autoresume=true")
    codes.append(sh(torchrun() + resumed, log))
    if any(codes):
        return {"status": "failed", "exit_codes": codes}
    a, b = _metric(ctx, "whole", "loss/train"), _metric(ctx, "half", "loss/train")
    after = [step for step in a if step > n]
    gaps = [abs(a[step] - b[step]) for step in after if step in b]
    name = "memory/peak_rss_gib" if ctx.tiny else "memory/peak_allocated_gib"
    memory = max(_metric(ctx, "whole", name).values(), default=None)
    ok = len(gaps) == len(after) == n and max(gaps) <= 1e-2 and memory is not None
    return {
        "status": "ok" if ok else "failed",
        "steps_compared": len(gaps),
        "max_loss_gap": max(gaps, default=None),
        "bitwise": all(g == 0 for g in gaps),
        "loss_first_last": [a.get(1), a.get(2 * n)],
        "peak_memory_gib": memory,
    }


def oom(ctx: Context) -> dict:
    """FSDP training whose first microbatch cannot fit in a capped memory: auto-microbatching
    must find a smaller one and finish."""
    if ctx.device != "cuda":
        return {"status": "skipped", "reason": "a real out-of-memory error needs CUDA"}
    log = ctx.logs / "oom.log"
    cap_gib = 8
    args = _train_args(
        ctx,
        "oom",
        *"strategy=fsdp precision=amp_bf16 max_duration=3ba global_train_batch_size=64".split(),
        *"device_train_microbatch_size=auto eval_interval=null save_folder=null".split(),
        "callbacks=[memory_monitor]",
    )
    rc = sh(torchrun() + [__file__, "--capped-gib", str(cap_gib), "--", *args], log)
    text = (ctx.work / "runs" / "oom" / "train.log").read_text() if rc == 0 else log.read_text()
    found = [line for line in text.splitlines() if "device_train_microbatch_size (auto)" in line]
    size = int(found[-1].split(":")[-1]) if found else None
    ok = rc == 0 and size is not None and size < 64
    return {
        "status": "ok" if ok else "failed",
        "rc": rc,
        "cap_gib": cap_gib,
        "microbatch_found": size,
    }


def run_capped(cap_gib: float, argv: list[str]) -> None:
    """Run scripts/train.py in this process with CUDA memory capped at `cap_gib`."""
    import torch

    local = int(os.environ.get("LOCAL_RANK", "0"))
    total = torch.cuda.get_device_properties(local).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total), local)
    sys.argv = argv
    runpy.run_path(str(ROOT / argv[0]), run_name="__main__")


def serve(ctx: Context) -> dict:
    """Two requests at once against scripts/serve.py on fsdp_resume's checkpoint."""
    log = ctx.logs / "serve.log"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    checkpoint = ctx.work / "runs" / "whole" / "checkpoints"
    cmd = [*python(), "scripts/serve.py", str(checkpoint), "--port", str(port)]
    cmd += ["--device", ctx.device, "--tokenizer", str(ctx.data / "mds")]
    with log.open("a") as out:
        server = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(port, server, timeout=120)
        prompts = ["def ", "import "]
        replies: list = [None, None]

        def ask(i: int) -> None:
            replies[i] = _complete(port, prompts[i])

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    ok = all(r is not None and r[0] == 200 and r[1] for r in replies)
    return {
        "status": "ok" if ok else "failed",
        "replies": replies,
        "server_exit": server.returncode,
    }


def _wait_healthy(port: int, server: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"serve.py exited {server.returncode} before answering")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"serve.py did not answer /health within {timeout:.0f} s")


def _complete(port: int, prompt: str) -> tuple[int, str]:
    body = json.dumps({"prompt": prompt, "max_tokens": 16, "temperature": 0}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=body,
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        reply = json.loads(response.read())
    return response.status, reply["choices"][0]["text"]


def fp8(ctx: Context) -> dict:
    """amp_fp8 against amp_bf16: the same initial weights and batches, compiled blocks."""
    import torch

    from llmfoundry.models.converters import float8_refusal

    steps = 3 if ctx.tiny else 30
    runs = {"amp_bf16": _bare_run(ctx, "amp_bf16", steps)}
    if reason := float8_refusal(torch.device(ctx.device)):
        return {"status": "skipped", "reason": reason, "amp_bf16": runs["amp_bf16"]}
    runs["amp_fp8"] = _bare_run(ctx, "amp_fp8", steps)
    bf16, f8 = runs["amp_bf16"]["losses"], runs["amp_fp8"]["losses"]
    gap = max(abs(x - y) for x, y in zip(bf16[-10:], f8[-10:], strict=True))
    speedup = runs["amp_fp8"]["tokens_per_s"] / runs["amp_bf16"]["tokens_per_s"]
    ok = gap < 0.1 and f8[-1] < f8[0]
    return {
        "status": "ok" if ok else "failed",
        "max_loss_gap_last10": gap,
        "fp8_over_bf16_tokens_per_s": speedup,
        **runs,
    }


def _bare_run(ctx: Context, precision: str, steps: int) -> dict:
    """`steps` optimizer steps of mpt-1b (mpt-tiny on CPU) on the prepared tokens, timed after
    the first third."""
    import dataclasses

    import numpy as np
    import torch

    from llmfoundry.callbacks.peak_flops import device_peak_flops
    from llmfoundry.core.precision import Precision
    from llmfoundry.models.converters import ConversionContext, Float8Training
    from llmfoundry.models.families import build_model
    from llmfoundry.optim import DecoupledAdamW

    device = torch.device(ctx.device)
    length, batch = seq_len(ctx), 2 if ctx.tiny else 4
    cfg = _tiny_config("mpt", "sdpa") if ctx.tiny else _named_config("mpt-1b")
    cfg = dataclasses.replace(cfg, max_seq_len=length, init_device="meta")
    torch.manual_seed(0)
    model = build_model(cfg)
    model.to_empty(device=device)
    model.init_weights()
    if precision == "amp_fp8":
        Float8Training().convert(model, ConversionContext("amp_bf16", device))
    if not ctx.tiny:  # inductor on CPU would take most of the dry run
        for block in model.transformer.blocks:
            block.compile()
    optimizer = DecoupledAdamW(model.parameters(), lr=3e-4)
    tokens = np.memmap(ctx.data / "tokens.bin", dtype=np.uint16, mode="r")
    autocast = Precision("amp_bf16", device)
    losses, sync = [], torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    start_at, start = steps // 3, 0.0
    for step in range(steps):
        if step == start_at:
            sync()
            start = time.perf_counter()
        rows = np.stack([tokens[(step * batch + r) * length :][:length] for r in range(batch)])
        ids = torch.from_numpy(rows.astype(np.int64)).to(device)
        with autocast.autocast():
            loss = model.loss(model(ids), {"labels": ids})
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    sync()
    tokens_per_s = (steps - start_at) * batch * length / (time.perf_counter() - start)
    peak, _ = device_peak_flops(device, "amp_bf16")
    flops = model.flops_per_token(length)
    return {
        "losses": [round(float(x), 4) for x in losses],
        "tokens_per_s": tokens_per_s,
        "mfu": None if peak is None else tokens_per_s * flops / peak,
    }


def _named_config(name: str):
    from hydra.utils import instantiate

    from llmfoundry.config.preflight import compose_config

    return instantiate(compose_config(ROOT / "conf", [f"model={name}"]).model)


def throughput(ctx: Context) -> dict:
    log, rows_file = ctx.logs / "throughput.log", ctx.work / "throughput.json"
    if ctx.tiny:
        shape = (
            "--gpu-models mpt-tiny --attn-impls sdpa --seq-len 128 --batch 2 --warmup 1 --steps 1"
        )
    else:
        shape = "--gpu-models mpt-125m mpt-1b --attn-impls sdpa flex --warmup 3 --steps 8"
    cmd = [*python(), "bench/train_throughput.py", "--gpu", "--device", ctx.device]
    checked(cmd + shape.split() + ["--compile", "off", "--json-out", str(rows_file)], log)
    rows = json.loads(rows_file.read_text())
    ok = bool(rows) and all(r.get("tokens_per_s") for r in rows)
    return {"status": "ok" if ok else "failed", "rows": rows}


PHASES = [
    Phase("prepare", prepare, 150, 600),
    Phase("cuda_tests", cuda_tests, 240, 600),
    Phase("parity", parity, 180, 600),
    Phase("families", families, 240, 600),
    Phase("kv_cache", kv_cache, 120, 600),
    Phase("fsdp_resume", fsdp_resume, 200, 900, after="prepare"),
    Phase("oom", oom, 150, 600, after="prepare"),
    Phase("serve", serve, 120, 600, after="fsdp_resume"),
    Phase("fp8", fp8, 240, 900, after="prepare", timed=True),
    Phase("throughput", throughput, 180, 600, timed=True),
    Phase("cuda_compile_tests", cuda_compile_tests, 240, 600, timed=True),
]


# --------------------------------------------------------------------------- the run


def run_phase(name: str, ctx: Context) -> None:
    """The child process: run one phase and write its result for the parent."""
    phase = next(p for p in PHASES if p.name == name)
    start = time.monotonic()
    try:
        result = phase.run(ctx)
    except Exception as err:  # a failed phase is a result, not the end of the run
        import traceback

        traceback.print_exc()
        result = {"status": "failed", "error": f"{type(err).__name__}: {err}"[:500]}
    result = {"phase": name, **result, "seconds": round(time.monotonic() - start, 1)}
    (ctx.work / "results" / f"{name}.json").write_text(json.dumps(result))


class Runner:
    """Starts each phase in its own process group, kills it at its timeout or the deadline."""

    def __init__(self, ctx: Context, deadline: float, only: set[str] | None) -> None:
        self.ctx, self.deadline, self.only = ctx, deadline, only
        self.results: dict[str, dict] = {}
        self.lock = threading.Lock()

    def run(self, phase: Phase) -> dict:
        if self.only is not None and phase.name not in self.only:
            return self._record(
                {"phase": phase.name, "status": "skipped", "reason": "not in --only"}
            )
        if phase.after and self.results.get(phase.after, {}).get("status") not in ("ok", None):
            reason = f"needs {phase.after}, which did not succeed"
            return self._record({"phase": phase.name, "status": "skipped", "reason": reason})
        budget = phase.cpu_timeout_s if self.ctx.tiny else phase.gpu_timeout_s
        timeout = min(budget, self.deadline - time.monotonic())
        if timeout < 10:
            reason = "no time left before --deadline-s"
            return self._record({"phase": phase.name, "status": "skipped", "reason": reason})
        return self._record(self._child(phase, timeout))

    def _child(self, phase: Phase, timeout: float) -> dict:
        ctx, start = self.ctx, time.monotonic()
        out = ctx.work / "results" / f"{phase.name}.json"
        out.unlink(missing_ok=True)
        cmd = [*python(), __file__, "--phase", phase.name, "--device", ctx.device]
        cmd += ["--work", str(ctx.work), "--logs", str(ctx.logs)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with (ctx.logs / f"{phase.name}.log").open("a") as log:
            child = subprocess.Popen(
                cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,  # so that a timeout ends its torchrun and servers too
            )  # fmt: skip
            try:
                timed_out = child.wait(timeout) is None
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                timed_out = True
        result = {"phase": phase.name, "seconds": round(time.monotonic() - start, 1)}
        if timed_out:
            return {**result, "status": "timeout"}
        if not out.exists():  # the child died before it could write its result
            return {**result, "status": "failed", "rc": child.returncode}
        return json.loads(out.read_text())

    def _record(self, result: dict) -> dict:
        with self.lock:
            self.results[result["phase"]] = result
            line = json.dumps(result)
            print(line, flush=True)
            with (self.ctx.logs.parent / "results.jsonl").open("a") as f:
                f.write(line + "\n")
        return result


def run_all(ctx: Context, deadline_s: float, only: set[str] | None) -> int:
    runner = Runner(ctx, time.monotonic() + deadline_s, only)
    untimed = [p for p in PHASES if not p.timed]
    waiting = {p.name: threading.Event() for p in PHASES}

    def run_when_ready(phase: Phase) -> None:
        if phase.after:
            waiting[phase.after].wait()
        runner.run(phase)
        waiting[phase.name].set()

    with ThreadPoolExecutor(len(untimed)) as pool:
        list(pool.map(run_when_ready, untimed))
    for phase in (p for p in PHASES if p.timed):
        runner.run(phase)
        waiting[phase.name].set()
    statuses = {name: r["status"] for name, r in runner.results.items()}
    print(json.dumps({"summary": statuses, **environment(ctx.device)}), flush=True)
    return 1 if any(s in ("failed", "timeout") for s in statuses.values()) else 0


def environment(device: str) -> dict:
    import torch

    env = {"device": device, "torch": torch.__version__, "python": sys.version.split()[0]}
    if device == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return env


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument(
        "--out",
        type=Path,
        default=ROOT / "outputs" / "gpu-acceptance",
        help="results.jsonl and logs/ (default outputs/gpu-acceptance)",
    )
    p.add_argument("--work", type=Path, help="data and runs (default: a temporary folder)")
    p.add_argument("--only", help="comma-separated phases to run (prepare runs if they need it)")
    p.add_argument("--deadline-s", type=float, default=540.0, help="the whole run's limit")
    p.add_argument("--phase", help=argparse.SUPPRESS)  # a child: run this phase only
    p.add_argument("--logs", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--capped-gib", type=float, help=argparse.SUPPRESS)  # oom's training process
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def chosen_phases(only: str | None) -> set[str] | None:
    """The phases --only names and those they read (fsdp_resume for serve, ...); None: all."""
    if only is None:
        return None
    chosen = set(only.split(","))
    if unknown := chosen - {p.name for p in PHASES}:
        raise SystemExit(f"error: --only: unknown phase(s) {sorted(unknown)}")
    while needed := {p.after for p in PHASES if p.name in chosen and p.after} - chosen:
        chosen |= needed
    return chosen


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.capped_gib is not None:
        run_capped(args.capped_gib, [a for a in args.rest if a != "--"])
        return 0
    if args.phase:
        run_phase(args.phase, Context(args.device, args.work, args.logs))
        return 0
    try:
        only = chosen_phases(args.only)
    except SystemExit as err:
        print(err, file=sys.stderr)
        return 2
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device is visible; --device cpu is the dry run", file=sys.stderr)
        return 2
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-acceptance-"))
    (work / "results").mkdir(parents=True, exist_ok=True)
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    (args.out / "results.jsonl").unlink(missing_ok=True)
    return run_all(Context(args.device, work, args.out / "logs"), args.deadline_s, only)


if __name__ == "__main__":
    sys.exit(main())
