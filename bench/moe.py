"""A mixture of experts against a dense model with the same active parameters, on the same tokens.

Trains two models in one run, on the demo data (`make demo`'s data/demo/mds: the Python standard
library's sources, 8192-token BPE, 256-token rows), from the same seed, in the same order, for
the same batches, with the recipe's trainer (`build_trainer` over conf/train.yaml, the path of
scripts/train.py), in fp32 on one CPU thread:

  dense : a Llama (`model=llama-tiny`'s family) whose SwiGLU is `top_k x expert_hidden` wide;
  moe   : a Mixtral (`model=mixtral-tiny`'s family): the same attention, norms, embeddings and
          head, each block's SwiGLU replaced by `--experts` experts of `expert_hidden`, of
          which a router picks `top_k` per token (plus the load-balancing loss).

A token goes through the same weights' worth of matrix multiplies on both sides (the MoE adds
its router, d_model x experts per block); both counts, total and active, are the models' own
(`num_params`, `num_params(active=True)`) and are printed. Reported per side: the validation
loss at the end (the whole val split), and training tokens per CPU-second (process time of the
training batches, evaluation left out, one thread: other jobs on the machine distort it much
less than wall time; wall time is printed beside it).

Then the all-to-all bytes per step of expert parallelism at ep = 1, 2, 4 (`--eps`): the trained
MoE on ep gloo processes (`FSDP(parallelism={"ep": ep})`'s mesh, its experts split with
llmfoundry/distributed/expert.py's `apply_ep`), each rank a forward and backward of its own
`--a2a-rows` validation rows (as data-parallel ranks, whose ranks ep borrows); every call of the
dispatch's all-to-all counted as it runs: in forward the rows this rank sends to the others
(its send splits, its own left out) x d_model x the element size, in backward the gradient rows
it sends back (its receive splits, its own left out). Beside it, the planner's figure for that
step (`plan_communication(...).expert_parallel`, llmfoundry/planning.py: even routing, so
(ep - 1) / ep of the copies leave), whose ratio to the measured one is the router's skew.
The counts' own exchange (E integers per layer and pass) is not in either.

    PYTHONPATH=. nice python bench/moe.py                    # bench/RESULTS.md
    PYTHONPATH=. python bench/moe.py --batches 4 --d-model 32 --n-layers 1 --experts 4 \\
        --expert-hidden 16 --eps 1 2 --a2a-rows 1          # a smoke run (tests/bench)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hydra.utils import instantiate

from llmfoundry.build import build_trainer
from llmfoundry.config.preflight import compose_config
from llmfoundry.core.engine import Callback
from llmfoundry.data import StreamingTextDataset
from llmfoundry.data.meta import read_meta
from llmfoundry.distributed import FSDP, expert
from llmfoundry.models.families import build_model
from llmfoundry.models.layers.moe import GroupedExperts
from llmfoundry.planning import Setup, plan_communication
from llmfoundry.utils.errors import UserError, exit_on_user_error
from llmfoundry.utils.logs import configure_logging

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
SIDES = ("dense", "moe")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--data",
        default=str(ROOT / "data" / "demo" / "mds"),
        help="MDS token rows with train and val splits (make demo writes them)",
    )
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--n-kv-heads", type=int, default=2)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument(
        "--expert-hidden",
        type=int,
        default=192,
        help="each expert's SwiGLU width; the dense one is top_k x this",
    )
    parser.add_argument(
        "--aux-loss-weight",
        type=float,
        default=0.02,
        help="load balancing (Mixtral's router_aux_loss_coef)",
    )
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8, help="rows per batch")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--eps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--a2a-rows", type=int, default=2, help="val rows per ep rank")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--debug", action="store_true", help="show the traceback of errors")
    args = parser.parse_args(argv)  # fmt: skip
    sizes = (args.batches, args.batch, args.threads, args.a2a_rows, *args.eps)
    if min(sizes) < 1:
        parser.error("--batches, --batch, --threads, --a2a-rows and --eps must be positive")
    if max(args.eps) > 4:
        parser.error("--eps: at most 4 processes on this machine's gloo")
    return args


def side_overrides(side: str, args: argparse.Namespace, meta: dict, root: Path) -> list[str]:
    """The conf/train.yaml overrides that train one side; only the feed-forward differs."""
    if side == "dense":
        ffn = ["model=llama-tiny", f"model.ffn_hidden_size={args.top_k * args.expert_hidden}"]
    else:
        ffn = ["model=mixtral-tiny", f"model.n_experts={args.experts}",
               f"model.top_k={args.top_k}", f"model.expert_hidden={args.expert_hidden}",
               f"model.aux_loss_weight={args.aux_loss_weight}"]  # fmt: skip
    return [
        *ffn,
        f"model.d_model={args.d_model}",
        f"model.n_heads={args.n_heads}",
        f"model.n_kv_heads={args.n_kv_heads}",
        f"model.n_layers={args.n_layers}",
        f"model.vocab_size={meta['vocab_size']}",
        f"model.max_seq_len={meta['seq_len']}",
        "model.rope_theta=10000.0",
        "model.tie_word_embeddings=false",
        f"data.remote={args.data}",
        "precision=fp32",
        f"global_train_batch_size={args.batch}",
        f"max_duration={args.batches}ba",
        f"optimizer.lr={args.lr}",
        f"scheduler.t_warmup={max(1, args.batches // 10)}ba",
        f"seed={args.seed}",
        f"run_name=moe-bench-{side}",
        f"save_folder={root / side / 'checkpoints'}",
        f"save_interval={args.batches}ba",
        f"eval_interval={args.batches}ba",
        "eval_first=false",
        "device_eval_batch_size=32",
        f"eval_subset_num_batches={-(-meta['splits']['val']['rows'] // 32)}",  # the whole split
        "callbacks=[nan_detector]",
        "loggers=[console,jsonl]",
        f"loggers.console.log_interval={max(1, args.batches // 5)}ba",
    ]


class TrainingClock(Callback):
    """CPU and wall seconds of the training batches (evaluation left out)."""

    def __init__(self) -> None:
        self.cpu_s = self.wall_s = 0.0
        self._cpu = self._wall = 0.0

    def _start(self, state, logger) -> None:
        self._cpu, self._wall = time.process_time(), time.perf_counter()

    def _stop(self, state, logger) -> None:
        self.cpu_s += time.process_time() - self._cpu
        self.wall_s += time.perf_counter() - self._wall

    batch_start = eval_after_all = _start
    batch_end = _stop


def train(side: str, args: argparse.Namespace, meta: dict, root: Path) -> dict:
    """Train one side; its counts, final validation loss, speed and trained weights."""
    rows = f"{args.batches} batches of {args.batch} x {meta['seq_len']} tokens"
    print(f"\n== {side}: {rows}", flush=True)
    cfg = compose_config(CONF, side_overrides(side, args, meta, root))
    configure_logging(root / side / "run" / "train.log")
    trainer = build_trainer(cfg, root / side / "run")
    clock = TrainingClock()
    trainer.state.callbacks.append(clock)
    trainer.fit()
    model = trainer.state.model
    records = (root / side / "run" / "metrics.jsonl").read_text().splitlines()
    metrics = [json.loads(line).get("metrics", {}) for line in records]
    evals = [m["eval/val/loss"] for m in metrics if "eval/val/loss" in m]
    tokens = trainer.state.timestamp.token
    return {
        "params": model.num_params(),
        "active_params": model.num_params(active=True),
        "val_loss": evals[-1],
        "tokens": tokens,
        "train_cpu_s": clock.cpu_s,
        "train_wall_s": clock.wall_s,
        "tokens_per_cpu_s": tokens / clock.cpu_s,
        "tokens_per_s": tokens / clock.wall_s,
        "model_config": instantiate(cfg.model),
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


# --- all-to-all bytes under expert parallelism ---------------------------------------------


class AllToAllLedger:
    """Bytes this rank sends in the ep dispatch's all-to-alls, wrapped around expert.py's
    `all_to_all_single_autograd` (module docstring)."""

    def __init__(self) -> None:
        self.forward = self.backward = 0
        self.calls = 0
        self._exchange = expert.all_to_all_single_autograd

    def __enter__(self) -> AllToAllLedger:
        expert.all_to_all_single_autograd = self._counted
        return self

    def __exit__(self, *exc: object) -> None:
        expert.all_to_all_single_autograd = self._exchange

    def _counted(self, x, output_split_sizes, input_split_sizes, group):
        me = dist.get_rank(group)
        row = x.shape[-1] * x.element_size()
        self.forward += (sum(input_split_sizes) - input_split_sizes[me]) * row
        self.calls += 1
        out = self._exchange(x, output_split_sizes, input_split_sizes, group)
        back = sum(output_split_sizes) - output_split_sizes[me]

        def count_gradient(grad: torch.Tensor) -> None:
            self.backward += back * grad.shape[-1] * grad.element_size()

        if out.requires_grad:
            out.register_hook(count_gradient)
        return out


def _ep_rank(rank: int, ep: int, port: int, model_config, state, rows, out: str) -> None:
    """One ep rank: the trained model, its experts split over the ep group, a forward and
    backward of this rank's rows with every all-to-all counted (`AllToAllLedger`)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(ep), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    strategy = FSDP("cpu", timeout_s=120, parallelism={"ep": ep})
    strategy.setup()
    try:
        model = build_model(model_config)
        model.load_state_dict(state)
        if ep > 1:
            for module in model.modules():
                if isinstance(module, GroupedExperts):
                    expert.apply_ep(module, strategy.mesh.ep_mesh)
        ids = rows[rank]
        with AllToAllLedger() as ledger:
            model.loss(model(ids), ids).backward()
        counted = {"forward": ledger.forward, "backward": ledger.backward, "calls": ledger.calls}
        Path(out, f"rank{rank}.json").write_text(json.dumps(counted))
    finally:
        strategy.teardown()


def measure_all_to_all(ep: int, trained: dict, rows: torch.Tensor, seq_len: int) -> dict:
    """One step of the trained MoE on `ep` gloo ranks: bytes each sends in the all-to-alls
    (measured), and the planner's figure for the same step."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    per_rank = rows.view(ep, -1, seq_len)
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(
            _ep_rank,
            args=(ep, port, trained["model_config"], trained["state"], per_rank, folder),
            nprocs=ep,
            start_method="spawn",
        )
        ranks = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(ep)]
    sent = [r["forward"] + r["backward"] for r in ranks]
    microbatch = per_rank.shape[1]
    setup = Setup(trained["model_config"], seq_len, "fp32", strategy="fsdp",
                  world_size=ep, ep=ep, global_batch=ep * microbatch)  # fmt: skip
    planned = plan_communication(setup, microbatch).expert_parallel
    return {"ep": ep, "measured_mean": sum(sent) / ep, "measured_max": max(sent),
            "forward_mean": sum(r["forward"] for r in ranks) / ep, "planned": planned,
            "calls": ranks[0]["calls"]}  # fmt: skip


def validation_rows(data: str, n: int) -> tuple[torch.Tensor, int]:
    """The first `n` rows of the val split [n, seq_len], and seq_len."""
    dataset = StreamingTextDataset(remote=data, split="val", shuffle=False)
    if len(dataset) < n:
        raise UserError(f"{data}/val has {len(dataset)} rows; the all-to-all count needs {n}")
    rows = torch.stack([dataset[i]["input_ids"] for i in range(n)]).long()
    return rows, rows.shape[1]


def report(
    results: dict[str, dict], exchanges: list[dict], args: argparse.Namespace, seq_len: int
) -> str:
    """The tables: each side's counts, loss and speed (ratios MoE / dense), then the all-to-all
    bytes per step at each ep, measured and planned."""
    dense, moe = results["dense"], results["moe"]
    lines = [
        f"d_model {args.d_model}, {args.n_layers} layers, {args.n_heads} heads "
        f"({args.n_kv_heads} kv), vocab and data of {args.data}; {args.batches} batches of "
        f"{args.batch} x {seq_len} tokens, lr {args.lr}, seed {args.seed}, fp32, {args.threads} "
        f"thread(s); MoE: {args.experts} experts of {args.expert_hidden}, top {args.top_k}, aux "
        f"loss weight {args.aux_loss_weight}; dense SwiGLU {args.top_k * args.expert_hidden}",
        "",
        "| side | parameters | active per token | tokens | val loss | tokens/CPU-s | tokens/s (wall) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for side in SIDES:
        r = results[side]
        lines.append(
            f"| {side} | {r['params']:,} | {r['active_params']:,} | {r['tokens']:,} | "
            f"{r['val_loss']:.4f} | {r['tokens_per_cpu_s']:,.0f} | {r['tokens_per_s']:,.0f} |"
        )
    lower = moe["val_loss"] < dense["val_loss"]
    lines += [
        "",
        f"MoE - dense val loss: {moe['val_loss'] - dense['val_loss']:+.4f} "
        f"({'lower: target met' if lower else 'not lower: target MISSED'}); speed MoE / dense: "
        f"{moe['tokens_per_cpu_s'] / dense['tokens_per_cpu_s']:.2f} (CPU time), "
        f"{moe['tokens_per_s'] / dense['tokens_per_s']:.2f} (wall)",
    ]
    if exchanges:
        rows = args.a2a_rows
        lines += [
            "",
            f"All-to-all bytes sent per rank for one step of {rows} row(s) x {seq_len} tokens per "
            "rank "
            "(forward + backward), the trained MoE:",
            "",
            "| ep | measured, mean over ranks | max rank | forward | planned | measured / planned |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for x in exchanges:
            ratio = f"{x['measured_mean'] / x['planned']:.2f}" if x["planned"] else "-"
            lines.append(
                f"| {x['ep']} | {x['measured_mean']:,.0f} | {x['measured_max']:,.0f} | "
                f"{x['forward_mean']:,.0f} | {x['planned']:,.0f} | {ratio} |"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    wall = time.perf_counter()
    with exit_on_user_error(args.debug):
        meta = read_meta(args.data)
        if meta is None:
            raise UserError(
                f"{args.data}: no meta.json; make the demo data first (make data/demo/mds/"
                "meta.json) or pass --data <MDS folder with train and val>"
            )
        with tempfile.TemporaryDirectory(prefix="bench-moe-") as folder:
            results = {side: train(side, args, meta, Path(folder)) for side in SIDES}
        rows, seq_len = validation_rows(args.data, max(args.eps) * args.a2a_rows)
        exchanges = [
            measure_all_to_all(ep, results["moe"], rows[: ep * args.a2a_rows], seq_len)
            for ep in args.eps
        ]
    print(f"\n== MoE against dense (wall {time.perf_counter() - wall:.0f} s)")
    print(report(results, exchanges, args, seq_len))
    if args.json:
        keep = ("params", "active_params", "val_loss", "tokens", "train_cpu_s", "train_wall_s",
                "tokens_per_cpu_s", "tokens_per_s")  # fmt: skip
        sides = {side: {k: r[k] for k in keep} for side, r in results.items()}
        payload = {"settings": vars(args), **sides, "all_to_all": exchanges}
        Path(args.json).write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
