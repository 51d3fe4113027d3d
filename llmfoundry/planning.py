"""Memory, communication and time plan of a training run, before any weight is allocated.

Answers "does this config fit, on which mesh, with how large a microbatch, and how long is a
step" for a device count and a parallel strategy laid out on the mesh of
llmfoundry/distributed/mesh.py (`ParallelDims`: dp_replicate x dp_shard x cp x tp x pp, and ep
borrowed from dp_shard x cp), built and checked as training builds and checks it (`Setup`), so a
planned mesh is one training takes. Parameter count and flops per token come from the model
itself (any family's `num_params` and `flops_per_token`, built on the meta device, so nothing is
allocated), the same numbers the speed monitor's MFU uses: for a mixture of experts the flops of
the active parameters (`num_params(active=True)`: router, top_k experts, shared expert), the
total for memory; the family's spec gives the activation bytes its blocks keep
(`ModelFamily.activation_bytes`), its parallel plan the blocks (the units sharded, split across
tensor-parallel ranks and assigned to pipeline stages) and the model's parameter names the rest:
the embedding (first stage) and the final norm and head (last stage; a tied head keeps a copy of
the embedding on the last stage when pp > 1, as torch.distributed.pipelining's tied weights do).

Memory per device is that of the pipeline stage that needs the most, the sum of:

- parameters: float32 master weights (autocast keeps parameters in float32), 4 bytes each;
- gradients: float32, 4 bytes per parameter;
- optimizer state: 8 bytes per parameter for Adam (two moments), 4 for Lion (one);
- a stage's weights are its layers' (the L blocks dealt to the pp stages in order, the first
  L mod pp stages one more) and its edge's, divided by tp (Megatron-LM's tensor parallelism:
  every block matrix, the embedding and the head split column- or row-wise; norms, a few
  d_model each, are counted as split too);
- data-parallel sharding divides these over the data-parallel ranks dp = world / (tp * cp * pp):
  DDP none; ZeRO-1 the optimizer state; ZeRO-2 also the gradients; FSDP full shard / ZeRO-3
  all three over dp_shard (FSDP: x cp, whose ranks average gradients as data-parallel ranks
  do: `Mesh.fsdp_mesh`); FSDP hybrid (dp_replicate > 1) all three within each replica's
  dp_shard x cp ranks, replicated across the replicas. Sharded strategies add the working
  copy of the largest unit (a block of the family's parallel plan, or an edge: the embedding,
  the final norm and an untied head), split by tp and gathered in full over dp, twice (the one
  in use and the one prefetched);
- routed experts (a mixture of experts, llmfoundry/models/layers/moe.py) are not split by tp
  (the MoE layer's tensor-parallel layout replicates them); under expert parallelism (ep = P,
  llmfoundry/distributed/expert.py) each of an ep group's P ranks holds 1/P of every block's
  experts, FSDP-sharded over the dp_shard x cp / P ranks holding the same ones (torchtitan's
  layout): their weights, gradients and optimizer state per device are those of FSDP over
  dp_shard x cp, as without ep, but the gathered working copy of a block holds 1/P of its
  experts;
- CPU offload moves the optimizer state, and under FSDP / ZeRO-3 the sharded parameters and
  gradients, to host memory (left out of the device total);
- activations: what autograd keeps per block for the backward of our implementation (counted
  by the family: MPT's in models/mpt/spec.py, Llama's in models/llama/spec.py), per token; with
  activation checkpointing only each block's float32 input plus one block's full activations
  (recomputed during backward). Tensor parallelism with sequence parallelism splits all of it
  by tp (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", eq. 2: sbh(34 + 5as/h)/t per layer), except the inputs of the two column-wise
  projections (attention's q/k/v, the MLP's up/gate), which the DTensor linear keeps as
  all-gathered, in full: 2 * d_model compute-dtype bytes per token per block more. An MoE
  layer keeps its router's probabilities and each token's top_k copies through its experts
  (`moe_activation_bytes`, measured against what autograd saves), whole under tp (each tp rank
  routes the gathered sequence); ep moves copies between ranks, not their number (even
  routing: a skewed router gives some ranks more). Context
  parallelism (cp = C, llmfoundry/distributed/context.py) gives each rank L / C tokens of
  every sequence, so all of these (and the logits below) are those of L / C tokens;
- gathered keys and values (cp > 1): attention all-gathers each layer's K and V over the cp
  ranks, [microbatch, L, kv_heads * head_dim] each in the compute dtype (kv heads split by tp),
  and keeps them for its backward: every layer-microbatch in flight, or only the recomputed
  layer's with activation checkpointing; plus one layer's dK and dV in backward;
- microbatches in flight under pipeline parallelism (Narayanan et al. 2021, "Efficient
  Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", sections 2.2.1-2.2.2,
  and torch.distributed.pipelining's ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B):
  GPipe keeps all m microbatches' activations on every stage; 1F1B keeps min(m, pp - s) on
  stage s (pp on the first); interleaved 1F1B with v chunks of L / (pp v) layers per rank keeps
  min(v m, 2 (pp - s - 1) + (v - 1) pp + 1) chunk-microbatches on rank s, the first rank's
  L (1 + (pp - 1) / (pp v)) layers' worth;
- logits: the [microbatch, seq, vocab] output and its gradient, in the compute dtype, on the
  last stage, split by tp (the vocabulary-sharded head, loss computed on the shards);
- attention bias: the causal bias [1, heads, L, L] that the dense-bias kernels (torch, sdpa) keep
  cached, in the compute dtype, when the model has ALiBi (a row per head, each tp rank
  building its own heads) or a sliding window (one mask for every head), L the longer of the
  sequence and max_seq_len (`AttentionMasks.causal_bias_shape`); flex and flash build none. A
  per-batch document mask (sequence_id) is not counted. Under context parallelism the dense
  kernels build, per forward and not cached, the rows of the rank's queries only: [heads (ALiBi)
  or 1, L / C, L] (a mask is needed even without ALiBi: the queries are not the last ones).

Communication per device per step (bytes sent by one device, ring collectives over n ranks
moving (n - 1) / n of the buffer: Patarasuk and Yuan 2009; all-reduce = reduce-scatter +
all-gather; parameters and gradients in float32, as autocast keeps them):

- FSDP / ZeRO-3: each microbatch all-gathers the stage's weights (split by tp) in forward and
  again in backward (`reshard_after_forward`), and one reduce-scatter of the gradients per step
  (`set_requires_gradient_sync` off while accumulating); hybrid adds an all-reduce of the shard
  across replicas; ZeRO-1/2: reduce-scatter of the gradients and all-gather of the updated
  weights; DDP: all-reduce of the gradients;
- TP with sequence parallelism: per block and microbatch, 2 all-gathers and 2 reduce-scatters of
  the [microbatch * seq, d_model] activation in forward and as many in backward (Korthikanti et
  al. 2022, section 4.2.2: the same volume as TP's 2 all-reduces per direction), and another 4
  for the forward recomputed under activation checkpointing; compute dtype; a layout that
  also exchanges activations in all-to-alls (MPT's fused Wqkv: its output, (n_heads + 2
  kv_n_heads) / n_heads block inputs' worth, split by tp, `ParallelPlan.tp_all_to_all`) sends
  (tp - 1) / tp of each such buffer in forward, in backward and in a recomputed forward;
- CP: per layer and microbatch, the all-gather of K and V in forward (again in a forward
  recomputed under activation checkpointing) and the reduce-scatter of dK and dV in backward,
  each sending (C - 1) / C of one layer's gathered K and V (above);
- PP: per microbatch and chunk, the stage's float32 output [microbatch, seq, d_model] (split by
  tp under sequence parallelism, by cp with context parallelism) sent forward and its gradient
  sent back;
- EP: per MoE layer and microbatch, the top_k copies of the rank's tokens dispatched to the
  ranks holding their experts and their outputs combined back, forward and backward (and a
  recomputed forward), (P - 1) / P of each leaving the rank (`all_to_all_bytes`); FSDP's
  gathers and reduce-scatters of the experts run over their dp_shard x cp / P ranks, on the
  1/P of them the rank's ep group holds.

Step time: the model's flops of the global batch over the devices at `mfu` of their peak (every
axis divides the work evenly; cp's causal load balance, chunks r and 2C-1-r on rank r, gives
every cp rank the same attention work; not so an MoE layer under tp, which every tp rank runs
on the whole sequence: its flops, counted once, make the step of an MoE at tp > 1 optimistic),
divided by 1 - the pipeline bubble, the fraction of a
step the schedule keeps a stage idle: (pp - 1) / (m + pp - 1) for GPipe and 1F1B with m
microbatches, (pp - 1) / (v m + pp - 1) interleaved with v stages per rank (Narayanan et al.
2021, sections 2.2.1-2.2.2). Communication is reported, not added: MFU is measured with it
overlapped.

Checked against peak memory measured on CPU (tests/planning/test_planning.py) and against the
published MPT-7B / MPT-30B setups.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass
from typing import Any

from llmfoundry.distributed.context import check_context_parallel
from llmfoundry.distributed.mesh import (
    PIPELINE_SCHEDULES,
    STRATEGY_AXES,
    ParallelDims,
    check_sequence_length,
    parallel_dims,
)
from llmfoundry.distributed.parallelize import check_tensor_parallel
from llmfoundry.distributed.pipeline import check_pipeline_split
from llmfoundry.models import parallel_plan
from llmfoundry.models.families import family_of
from llmfoundry.models.layers.kernels import DENSE_BIAS_IMPLS
from llmfoundry.models.layers.moe import MoE, MoESpec
from llmfoundry.models.plan import ParallelPlan
from llmfoundry.utils.errors import UserError

# Training's strategy names (conf/strategy/<name>.yaml) and the mesh axes each takes.
STRATEGIES = tuple(STRATEGY_AXES)
SCHEDULES = ("1f1b", "gpipe", "interleaved")

PRECISIONS = ("fp32", "amp_bf16", "amp_fp16")
# What each block saves with activation checkpointing, and what a pipeline stage sends: its
# float32 input (the residual stream stays float32 under autocast).
CHECKPOINT_BYTES = 4
PARAM_BYTES = GRAD_BYTES = 4
_UNITS = {"kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_SHARDED_PARAMS = ("fsdp", "deepspeed_zero3")


def parse_bytes(text: str) -> int:
    """'80GB', '141GiB', '512mb' or a plain number of bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else ""
    if not match or (unit and unit not in _UNITS):
        raise UserError(f"memory size {text!r}: write a number with a unit, e.g. 80GB or 141GiB")
    return int(float(match.group(1)) * _UNITS.get(unit, 1))


def optimizer_state_bytes(optimizer_target: str) -> int:
    """Bytes of optimizer state per parameter, from the optimizer config's `_target_`."""
    name = optimizer_target.rsplit(".", 1)[-1].lower()
    if "lion" in name:
        return 4
    if "adam" in name:
        return 8
    if name == "sgd":
        return 4
    raise UserError(
        f"no optimizer-state size known for {optimizer_target!r}; the planner knows Adam/AdamW "
        "(8 bytes per parameter), Lion (4) and SGD with momentum (4)"
    )


def bubble_fraction(
    pp: int, microbatches: int, schedule: str = "1f1b", stages_per_rank: int = 1
) -> float:
    """The fraction of a step a pipeline stage idles: (pp - 1) / (m + pp - 1) for GPipe and 1F1B,
    (pp - 1) / (v m + pp - 1) for interleaved 1F1B with v stages per rank (Narayanan et al. 2021,
    sections 2.2.1-2.2.2)."""
    if pp == 1:
        return 0.0
    chunks = stages_per_rank if schedule == "interleaved" else 1
    return (pp - 1) / (chunks * microbatches + pp - 1)


@dataclass(frozen=True)
class ModelCounts:
    """What the plan reads of the model, counted once on the meta device: parameters of each
    block (input to output) and of the edges (`first`: the embeddings, on the first pipeline
    stage; `last`: the final norm and an untied head, on the last; `tied`: the embedding again
    when the head is tied to it, which the last stage holds when it is not also the first).
    `plan`: the family's parallel plan, which training's checks of a mesh read (the planner
    asks the same ones: `Setup`); `tp_all_to_all`: its layout's all-to-all volume per block
    forward, in block inputs (`ParallelPlan.tp_all_to_all`); `attn_bias`: the heads (1: one
    mask for every head) and side of the causal bias its attention kernel keeps cached, (0, 0)
    when it builds none; `cp_bias_heads`: the heads of the dense bias rows a dense-bias kernel
    builds per forward under context parallelism (its queries' rows only: ALiBi's per head,
    else one mask), 0 for flex and flash (module docstring). A mixture of experts: the
    parameters one token goes through (`active_params`; `flops_per_token` is theirs), each
    block's routed experts (`experts`, sharded over ep; the rest of a block's parameters are
    split by tp), `n_experts` and `top_k` per MoE block, and the bytes per token its MoE layer
    keeps (`moe_activation_bytes`, not part of `block_activation_bytes`)."""

    n_params: int
    flops_per_token: int
    blocks: tuple[int, ...]
    first: int
    last: int
    tied: int
    block_activation_bytes: int  # per token
    d_model: int
    vocab_size: int
    n_heads: int
    n_kv_heads: int
    plan: ParallelPlan = dataclasses.field(repr=False, compare=False)
    tp_all_to_all: float = 0.0
    attn_bias: tuple[int, int] = (0, 0)  # heads, side of the cached attention bias; 0: none
    cp_bias_heads: int = 0
    active_params: int = 0  # what one token goes through (an MoE's top_k experts); 0: n_params
    experts: tuple[int, ...] = ()  # per block, its routed experts' parameters (0: a dense block)
    n_experts: int = 0  # routed experts per MoE block
    top_k: int = 0  # experts each token goes to (its copies)
    moe_activation_bytes: int = 0  # per token per MoE block, the MoE layer's (not split by tp)
    moe_input_bytes: int = 4  # bytes of one element of the MoE layer's input (its token copies)
    head_dim: int = 0  # 0: d_model / n_heads

    def __post_init__(self) -> None:
        if not self.active_params:
            object.__setattr__(self, "active_params", self.n_params)
        if not self.experts:
            object.__setattr__(self, "experts", (0,) * len(self.blocks))

    @property
    def moe(self) -> bool:
        """Whether any block routes its tokens to experts."""
        return any(self.experts)

    @property
    def kv_dim(self) -> int:
        """Width of one token's keys (and of its values): the key/value heads' (GQA: fewer)."""
        return self.n_kv_heads * (self.head_dim or self.d_model // self.n_heads)


def count_model(config: Any, seq_len: int, precision: str) -> ModelCounts:
    """`config`'s counts (any family), from a model built on the meta device."""
    family = family_of(config)
    model = family.build(config, init_device="meta")
    plan = parallel_plan(model)
    blocks = plan.blocks
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    embedding = model.transformer.wte.weight  # every family's token embedding (family.CausalLM)
    first = last = 0
    for name, p in model.named_parameters():
        if id(p) in in_blocks:
            continue
        if name.startswith(("transformer.wte.", "transformer.wpe.")):
            first += p.numel()
        else:
            last += p.numel()
    untied = any(
        p is not embedding and p.shape == embedding.shape
        for n, p in model.named_parameters()
        if id(p) not in in_blocks and not n.startswith("transformer.wte.")
    )
    # The config field is kv_n_heads in MPT's config and n_kv_heads in Llama's.
    kv_heads = getattr(config, "n_kv_heads", None) or getattr(config, "kv_n_heads", None)
    masks = model.transformer.masks  # every family's AttentionMasks
    attn_bias, cp_bias_heads = (0, 0), 0
    builds = masks.alibi is not None or masks.window is not None
    if config.attn_impl in DENSE_BIAS_IMPLS:
        cp_bias_heads = masks.causal_bias_shape(seq_len)[1]
        if builds:
            attn_bias = masks.causal_bias_shape(seq_len)[1:3]
    moes = [[m for m in b.modules() if isinstance(m, MoE)] for b in blocks]
    spec = next((m[0].spec for m in moes if m), None)
    return ModelCounts(
        n_params=model.num_params(),
        flops_per_token=model.flops_per_token(seq_len),
        blocks=tuple(sum(p.numel() for p in b.parameters()) for b in blocks),
        first=first,
        last=last,
        tied=0 if untied else embedding.numel(),
        block_activation_bytes=family.activation_bytes(config, precision),
        d_model=config.d_model,
        vocab_size=config.vocab_size,
        n_heads=config.n_heads,
        n_kv_heads=kv_heads or config.n_heads,
        plan=plan,
        tp_all_to_all=plan.tp_all_to_all,
        attn_bias=attn_bias,
        cp_bias_heads=cp_bias_heads,
        head_dim=getattr(config, "head_dim", None) or config.d_model // config.n_heads,
        **(_moe_counts(model, moes, spec, precision) if spec else {}),
    )


def _moe_counts(model: Any, moes: list[list[MoE]], spec: MoESpec, precision: str) -> dict:
    """An MoE model's counts: active parameters (the model's own count: router, top_k experts,
    shared expert), each block's routed experts, and the MoE layer's activations."""
    experts = [sum(p.numel() for m in ms for p in m.experts.parameters()) for ms in moes]
    low_precision_input = getattr(getattr(model, "spec", None), "low_precision_norm", False)
    input_bytes = 2 if precision != "fp32" and low_precision_input else 4
    d_model = model.config.d_model
    return {
        "active_params": model.num_params(active=True),
        "experts": tuple(experts),
        "n_experts": spec.n_experts,
        "top_k": spec.top_k,
        "moe_activation_bytes": moe_activation_bytes(spec, d_model, precision, input_bytes),
        "moe_input_bytes": input_bytes,
    }


def moe_activation_bytes(spec: MoESpec, d_model: int, precision: str, input_bytes: int = 4) -> int:
    """Bytes autograd keeps per token for the backward of an MoE layer
    (llmfoundry/models/layers/moe.py), with d = d_model, h = expert_hidden, k = top_k, E =
    n_experts, b = `input_bytes` (of one element of the layer's input: float32, the residual
    stream's norm output, unless a low-precision norm makes it the compute dtype). The router:
    its softmax output (4E), the top-k sum renormalised by (4); per token copy: its top-k index,
    its weight, its token and sort indices (8 + 4 + 8 + 8 + 4, counting the weight gathered in
    sorted order), the gathered copy (bd), the expert's gate and up outputs, silu(gate) and the
    product fed to w_down (4bh), and the expert's output and the weighted output (2bd):
    4E + 4 + k (32 + 3bd + 4bh). Under mixed precision the experts compute in autocast's dtype
    (GroupedExperts casts their input and weights, as F.linear under autocast does), so a copy
    keeps 2-byte tensors instead: its input's 2-byte copy, the expert's four hidden tensors and
    its output (2d + 8h + 2d), the weighted output in float32 (4d): k (32 + 8d + 8h); and the
    router's 2-byte copy of a float32 input (2d). A shared expert keeps a SwiGLU's 16s
    (mixed: 8s + its two projections' 2-byte copies of the input, 4d); its gate, the gate's
    sigmoid and the shared output it scales (4 + 4d; mixed: its 2-byte input copy too, 2 + 4d).
    Measured per token against the tensors autograd saves (tests/planning/test_moe_planning.py)."""
    d, h, k, e = d_model, spec.expert_hidden, spec.top_k, spec.n_experts
    s, b = spec.shared_expert_hidden, input_bytes
    if precision == "fp32":
        routed = 4 * e + 4 + k * (32 + 3 * b * d + 4 * b * h)
    else:
        routed = 4 * e + 4 + k * (32 + 8 * d + 8 * h)
    if precision == "fp32":
        return routed + 16 * s + (4 + 4 * d) * spec.shared_expert_gate
    casts = 2 * d * (b == 4) + (8 * s + 4 * d) * (s > 0)
    return routed + casts + (2 + 4 * d) * spec.shared_expert_gate


@dataclass
class MemoryPlan:
    """Bytes per device of each part of a training step on pipeline stage `stage` (the one that
    needs the most), and what it assumed."""

    n_params: int
    flops_per_token: int  # of the active parameters (an MoE's top_k experts)
    params: float
    grads: float
    optimizer: float
    working: float
    activations: float
    logits: float
    attn_bias: float = 0.0
    gathered_kv: float = 0.0
    stage: int = 0
    active_params: int = 0

    @property
    def total(self) -> float:
        return (
            self.params
            + self.grads
            + self.optimizer
            + self.working
            + self.activations
            + self.logits
            + self.attn_bias
            + self.gathered_kv
        )


@dataclass
class CommunicationPlan:
    """Bytes one device sends per optimizer step, by collective (the module docstring says
    which): data parallelism's `all_gather` / `reduce_scatter` (FSDP, ZeRO) and `all_reduce`
    (DDP, hybrid replicas), tensor parallelism's activation all-gathers and reduce-scatters
    `tensor_parallel`, context parallelism's key/value all-gathers and their gradients'
    reduce-scatters `context_parallel`, and the pipeline's activation and gradient sends
    `pipeline`."""

    all_gather: float = 0.0
    reduce_scatter: float = 0.0
    all_reduce: float = 0.0
    tensor_parallel: float = 0.0
    context_parallel: float = 0.0
    pipeline: float = 0.0
    expert_parallel: float = 0.0

    @property
    def total(self) -> float:
        return (
            self.all_gather
            + self.reduce_scatter
            + self.all_reduce
            + self.tensor_parallel
            + self.context_parallel
            + self.pipeline
            + self.expert_parallel
        )


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def planned_precision(precision: str, has_bf16: bool) -> str:
    """`precision` as training resolves it on the planned GPU (llmfoundry.core.precision): auto
    is amp_bf16, but fp32 on a GPU without bf16 tensor cores (`has_bf16` False; scripts/plan.py
    asks callbacks.peak_flops.gpu_has_bf16 of the GPU it plans for)."""
    if precision != "auto":
        return precision
    return "amp_bf16" if has_bf16 else "fp32"


@dataclass
class Setup:
    """The run being planned: everything that changes memory per device.

    The mesh: `tp` tensor-parallel, `cp` context-parallel and `pp` pipeline-parallel ways;
    the data-parallel ranks world_size / (tp * cp * pp) are laid out by `strategy`, a
    conf/strategy name (DDP: replicas; DeepSpeed ZeRO and FSDP: shards) or, for FSDP, by
    `dp_replicate` and `dp_shard` as `ParallelDims` takes them (-1: the rest; dp_replicate > 1:
    hybrid sharding).
    `schedule` and `stages_per_rank` (v, interleaved only) are the pipeline's; `global_batch`
    (sequences per step) sets the microbatches per step, which the pipeline keeps in flight
    and which repeat the gathers.

    Construction refuses, in one line, every mesh training would refuse: with training's own
    checks where they are functions of the model's plan (`check_tensor_parallel`,
    `check_pipeline_split`, `check_context_parallel`) and of the mesh (`parallel_dims`: tp, cp
    and pp only under FSDP; `check_sequence_length`). The interleaved schedule, which training
    does not run yet, can be planned (a forecast), not recommended."""

    model: Any  # a model config of any family (llmfoundry.models.families)
    seq_len: int
    precision: str = "amp_bf16"
    strategy: str = "single"
    world_size: int = 1
    gpus_per_node: int = 8
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    optimizer_bytes: int = 8
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1
    global_batch: int | None = None
    counts: ModelCounts | None = None  # counted from `model` when None
    dims: ParallelDims = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise UserError(f"strategy {self.strategy!r}: use one of {', '.join(STRATEGIES)}")
        if self.precision not in PRECISIONS:
            raise UserError(f"precision {self.precision!r}: use fp32, amp_bf16 or amp_fp16")
        if self.schedule not in SCHEDULES:
            raise UserError(f"schedule {self.schedule!r}: use one of {', '.join(SCHEDULES)}")
        sizes = (self.world_size, self.gpus_per_node, self.tp, self.pp, self.cp, self.ep)
        if min(*sizes, self.stages_per_rank) < 1:
            raise UserError(
                "world_size, gpus_per_node, tp, pp, cp, ep and stages_per_rank must be positive"
            )
        if self.cpu_offload and self.strategy in ("single", "ddp"):
            raise UserError("CPU offload needs a sharded strategy: fsdp or deepspeed_zero1-3")
        if (self.schedule == "interleaved") != (self.stages_per_rank > 1) and self.pp > 1:
            raise UserError(
                "the interleaved schedule takes 2 or more stages per rank and the others 1: "
                "use --schedule interleaved with --stages-per-rank 2 or more, or leave it out"
            )
        if self.counts is None:
            self.counts = count_model(self.model, self.seq_len, self.precision)
        # The model and the device count first: they are what a wrong tp or pp breaks, whatever
        # the strategy (single's "use --world-size tp x pp" would hide them).
        self._check_model_fits_mesh()
        self._check_world()
        self.dims = self._mesh()
        self._check_sequence()

    @property
    def model_ways(self) -> int:
        """Devices that hold one data-parallel rank's share: tp x cp x pp."""
        return self.tp * self.cp * self.pp

    def _check_world(self) -> None:
        world, model_ways = self.world_size, self.model_ways
        axes = f"tp={self.tp}{f' x cp={self.cp}' * (self.cp > 1)} x pp={self.pp}"
        if world % model_ways:
            raise UserError(
                f"{axes} = {model_ways} does not divide the {world} devices: use a --world-size "
                f"that is a multiple of {model_ways}, or axes whose product divides {world}"
            )

    def _check_model_fits_mesh(self) -> None:
        """The model's own refusals of the axes: training's checks, on the family's plan."""
        counts = self.counts
        if self.tp > 1:
            check_tensor_parallel(counts.plan, self.tp, setting="--tp")
        check_pipeline_split(counts.plan, self.pp, setting="--pp")
        v = self.stages_per_rank if self.schedule == "interleaved" else 1
        layers = len(counts.blocks)
        if self.pp * v > layers:  # (training runs no interleaved schedule yet: the plan's own)
            raise UserError(
                f"pp={self.pp} x {v} stages per rank = {self.pp * v} stages, more than the "
                f"model's {layers} layers: use --pp {layers // v} or fewer"
            )
        if self.cp > 1:
            check_context_parallel(counts.plan, self.cp, setting="--cp")
        # Training's check_expert_parallel, read from the counts (its modules are not built).
        if self.ep > 1 and not counts.moe:
            raise UserError(
                f"--ep={self.ep}: this model has no experts to split (no mixture-of-experts "
                "layer); use an MoE model, or leave --ep out"
            )
        if counts.moe and counts.n_experts % self.ep:
            raise UserError(
                f"--ep={self.ep} does not divide the model's {counts.n_experts} experts: choose "
                "an ep that divides the expert count"
            )

    def _check_sequence(self) -> None:
        """Sequence and context parallelism cut every sequence into equal parts, as training's
        data requires (`check_sequence_length`)."""
        check_sequence_length(self.dims, self.seq_len)

    def _mesh(self) -> ParallelDims:
        """The mesh as training builds it from the config's parallelism block
        (`parallel_dims`, which refuses the axes a strategy cannot take). DDP replicates over
        the data-parallel ranks and DeepSpeed shards over them; FSDP takes --dp-replicate and
        --dp-shard (hybrid sharding: replicas of shards)."""
        world, model_ways = self.world_size, self.model_ways
        if self.strategy != "fsdp" and (self.dp_replicate != 1 or self.dp_shard != -1):
            raise UserError(
                f"--dp-replicate and --dp-shard lay out FSDP's mesh; strategy {self.strategy} "
                "sets them itself: leave them out or use --strategy fsdp"
            )
        product = self.dp_replicate * self.dp_shard * model_ways
        if self.dp_shard != -1 and product != world:
            raise UserError(
                f"dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x cp={self.cp} x "
                f"tp={self.tp} x pp={self.pp} = {product}, but there are {world} devices: use "
                f"--world-size {product} or leave --dp-shard out (the rest)"
            )
        layout = {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard}
        if self.strategy == "ddp":
            layout = {"dp_replicate": world // model_ways, "dp_shard": 1}
        axes = {"cp": self.cp, "tp": self.tp, "pp": self.pp, "ep": self.ep}
        return parallel_dims({**layout, **axes}, world, strategy=self.strategy)

    @property
    def n_params(self) -> int:
        return self.counts.n_params

    @property
    def flops_per_token(self) -> int:
        return self.counts.flops_per_token

    @property
    def block_activation_bytes(self) -> int:
        return self.counts.block_activation_bytes

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    def microbatches(self, microbatch: int) -> int | None:
        """Microbatches per device per step (None when the global batch is not known)."""
        if self.global_batch is None:
            return None
        return max(1, math.ceil(self.global_batch / self.dp_size / microbatch))

    @functools.cached_property
    def stage_layers(self) -> list[list[int]]:
        """The blocks each pipeline rank holds: the L blocks cut into pp * v chunks in order (the
        first L mod (pp v) one block longer), chunk c on rank c mod pp."""
        chunks = self.pp * (self.stages_per_rank if self.schedule == "interleaved" else 1)
        size, extra = divmod(len(self.counts.blocks), chunks)
        ranks: list[list[int]] = [[] for _ in range(self.pp)]
        start = 0
        for c in range(chunks):
            end = start + size + (c < extra)
            ranks[c % self.pp].extend(range(start, end))
            start = end
        return ranks

    def stage_weights(self, stage: int) -> tuple[float, float]:
        """Parameters rank `stage` holds before data-parallel sharding (split by tp; routed
        experts are not: the MoE layer's tensor-parallel layout replicates them), and its
        largest unit as FSDP gathers it (a block, its experts over the ep group's 1/ep of
        them, or its edge: the root, under pp = 1)."""
        counts, last = self.counts, self.pp - 1
        layers = self.stage_layers[stage]
        dense = [(counts.blocks[i] - counts.experts[i]) / self.tp for i in layers]
        experts = [counts.experts[i] for i in layers]
        edge = counts.first * (stage == 0) + counts.last * (stage == last)
        edge += counts.tied * (stage == last and self.pp > 1)
        units = [d + e / self.ep for d, e in zip(dense, experts, strict=True)]
        return sum(dense) + sum(experts) + edge / self.tp, max([edge / self.tp, *units])

    def stage_experts(self, stage: int) -> int:
        """Routed-expert parameters of rank `stage`'s blocks, before any sharding."""
        return sum(self.counts.experts[i] for i in self.stage_layers[stage])

    def stage_moe_layers(self, stage: int) -> int:
        """How many of rank `stage`'s blocks route their tokens to experts."""
        return sum(1 for i in self.stage_layers[stage] if self.counts.experts[i])

    def in_flight(self, stage: int, microbatches: int | None) -> tuple[float, int]:
        """Layer-microbatches of activations rank `stage` keeps at its peak, and microbatches of
        its edges' (embedding output, logits): the schedule's (module docstring)."""
        layers = len(self.stage_layers[stage])
        if self.pp == 1:
            return layers, 1
        m = microbatches
        if m is None and self.schedule == "gpipe":
            raise UserError("GPipe keeps every microbatch in flight: give the global batch size")
        if self.schedule == "gpipe":
            return layers * m, m
        if self.schedule == "1f1b":
            held = self.pp - stage if m is None else min(m, self.pp - stage)
            return layers * held, held
        v = self.stages_per_rank
        held = 2 * (self.pp - stage - 1) + (v - 1) * self.pp + 1
        held = held if m is None else min(v * m, held)
        return layers / v * held, math.ceil(held / v)


def _shards(setup: Setup) -> tuple[int, int, int]:
    """How many ways parameters, gradients and optimizer state are split across the
    data-parallel ranks (FSDP: and the context-parallel ranks of each, `Mesh.fsdp_mesh`)."""
    dp, shard = setup.dp_size, setup.dims.dp_shard * setup.cp
    return {
        "single": (1, 1, 1),
        "ddp": (1, 1, 1),
        "deepspeed_zero1": (1, 1, dp),
        "deepspeed_zero2": (1, dp, dp),
        "deepspeed_zero3": (dp, dp, dp),
        "fsdp": (shard, shard, shard),
    }[setup.strategy]


def _stage_memory(setup: Setup, microbatch: int, stage: int) -> MemoryPlan:
    counts, tp = setup.counts, setup.tp
    weights, unit = setup.stage_weights(stage)
    p_shards, g_shards, o_shards = _shards(setup)
    params = weights * PARAM_BYTES / p_shards
    grads = weights * GRAD_BYTES / g_shards
    optimizer = weights * setup.optimizer_bytes / o_shards
    sharded_params = setup.strategy in _SHARDED_PARAMS
    if setup.cpu_offload:
        optimizer = 0.0
        if sharded_params:
            params = grads = 0.0
    working = 2 * unit * PARAM_BYTES if sharded_params and p_shards > 1 else 0.0
    d = counts.d_model
    compute_bytes = 4 if setup.precision == "fp32" else 2
    tokens = microbatch * setup.seq_len / setup.cp  # this rank's part of each sequence
    # One block's saved activations per device; sequence parallel splits all but the gathered
    # inputs of the two column-wise projections.
    per_block = counts.block_activation_bytes * tokens / tp
    per_block += 2 * compute_bytes * d * tokens * (1 - 1 / tp)
    # An MoE layer (tokens gathered over the sequence, experts replicated over tp) keeps its
    # own, whole: the routing and top_k copies of each token.
    moe = counts.moe_activation_bytes * tokens
    moe_share = setup.stage_moe_layers(stage) / max(1, len(setup.stage_layers[stage]))
    layer_microbatches, held = setup.in_flight(stage, setup.microbatches(microbatch))
    if setup.activation_checkpointing:
        blocks = layer_microbatches * CHECKPOINT_BYTES * d * tokens / tp
        blocks += per_block + moe * (moe_share > 0) if layer_microbatches else 0.0
    else:
        blocks = layer_microbatches * (per_block + moe * moe_share)
    # Embedding output (first stage), final norm input and the head's input (last stage).
    edges = 4 * (stage == 0) + (4 + compute_bytes) * (stage == setup.pp - 1)
    edges_bytes = held * edges * d * tokens / tp
    logits = 0.0
    if stage == setup.pp - 1:
        logits = held * 2 * tokens * counts.vocab_size * compute_bytes / tp
    heads, side = counts.attn_bias  # ALiBi's heads split by tp; one mask for all heads is whole
    rows = side
    if setup.cp > 1:  # the bias rows of this rank's queries, against every key, per forward
        heads, side, rows = counts.cp_bias_heads, setup.seq_len, setup.seq_len / setup.cp
    attn_bias = (heads if heads == 1 else heads // tp) * rows * side * compute_bytes
    return MemoryPlan(
        n_params=counts.n_params,
        flops_per_token=counts.flops_per_token,
        params=params,
        grads=grads,
        optimizer=optimizer,
        working=working,
        activations=blocks + edges_bytes,
        logits=logits,
        attn_bias=attn_bias,
        gathered_kv=_gathered_kv(setup, microbatch, layer_microbatches),
        stage=stage,
        active_params=counts.active_params,
    )


def _layer_kv_bytes(setup: Setup, microbatch: int) -> float:
    """One layer's keys and values over whole sequences, [microbatch, seq, kv_dim] each, in the
    compute dtype, the key/value heads split by tp: what context parallelism all-gathers."""
    compute_bytes = 4 if setup.precision == "fp32" else 2
    kv = 2 * microbatch * setup.seq_len * setup.counts.kv_dim * compute_bytes
    return kv / setup.tp


def _gathered_kv(setup: Setup, microbatch: int, layer_microbatches: float) -> float:
    """The all-gathered keys and values a context-parallel rank holds at its peak: attention
    keeps each layer's for its backward (every layer-microbatch in flight; with activation
    checkpointing only the recomputed layer's), plus one layer's gradients of them, dK and dV,
    in backward before their reduce-scatter."""
    if setup.cp == 1:
        return 0.0
    kept = 1 if setup.activation_checkpointing else layer_microbatches
    return (kept + 1) * _layer_kv_bytes(setup, microbatch)


def plan_memory(setup: Setup, microbatch: int) -> MemoryPlan:
    """Bytes per device for one step of `microbatch`-sequence microbatches, on the pipeline rank
    that needs the most."""
    return max(
        (_stage_memory(setup, microbatch, s) for s in range(setup.pp)), key=lambda p: p.total
    )


def plan_communication(setup: Setup, microbatch: int) -> CommunicationPlan:
    """Bytes one device sends per step (module docstring), on the pipeline rank that needs the
    most memory (the pipeline sends: a middle rank's, which sends both ways)."""
    stage = plan_memory(setup, microbatch).stage
    weights = setup.stage_weights(stage)[0] * PARAM_BYTES
    m = setup.microbatches(microbatch) or 1
    plan = CommunicationPlan()
    n = setup.dims.dp_shard * setup.cp
    if setup.strategy in _SHARDED_PARAMS:
        # Experts are gathered within their ep group's share (1/ep of them) over the
        # dp_shard x cp / ep ranks that shard it; the rest over all n.
        experts = setup.stage_experts(stage) * PARAM_BYTES
        gathered = (weights - experts) * _ring(n) + experts / setup.ep * _ring(n // setup.ep)
        plan.all_gather = 2 * m * gathered
        plan.reduce_scatter = gathered
        plan.all_reduce = 2 * weights / n * _ring(setup.dims.dp_replicate)
    elif setup.strategy in ("deepspeed_zero1", "deepspeed_zero2"):
        plan.all_gather = plan.reduce_scatter = weights * _ring(n)
    else:
        plan.all_reduce = 2 * weights * _ring(setup.dims.dp_replicate)
    counts = setup.counts
    compute_bytes = 4 if setup.precision == "fp32" else 2
    activation = microbatch * setup.seq_len / setup.cp * counts.d_model  # this rank's tokens
    layers = len(setup.stage_layers[stage])
    collectives = 8 + 4 * setup.activation_checkpointing
    exchanges = (2 + setup.activation_checkpointing) * counts.tp_all_to_all / setup.tp
    plan.tensor_parallel = (
        m * layers * (collectives + exchanges) * _ring(setup.tp) * activation * compute_bytes
    )
    # Context parallelism: per layer and microbatch, keys and values all-gathered in forward
    # (again in a recomputed forward), their gradients reduce-scattered in backward.
    passes = 2 + setup.activation_checkpointing
    kv = _layer_kv_bytes(setup, microbatch)
    plan.context_parallel = m * layers * passes * _ring(setup.cp) * kv
    if setup.pp > 1:
        v = setup.stages_per_rank if setup.schedule == "interleaved" else 1
        plan.pipeline = m * v * 2 * activation * CHECKPOINT_BYTES / setup.tp
    plan.expert_parallel = m * setup.stage_moe_layers(stage) * all_to_all_bytes(setup, microbatch)
    return plan


def _ring(n: int) -> float:
    """The fraction of a buffer one of n ranks sends in a ring collective (or, routing evenly,
    in an all-to-all: all but its own 1/n)."""
    return (n - 1) / n


def all_to_all_bytes(setup: Setup, microbatch: int) -> float:
    """Bytes one rank sends in the all-to-alls of one MoE layer and microbatch: its tokens'
    top_k copies [tokens x top_k, d_model], dispatched to the ranks holding their experts in
    the layer input's dtype (float32, the residual stream's norm output: `moe_input_bytes`),
    and their outputs combined back in the experts' compute dtype (autocast's 2 bytes under
    mixed precision: GroupedExperts casts after the dispatch), in forward and (their
    gradients, in the same dtypes) in backward, and again in a forward recomputed under
    activation checkpointing; with tokens routed evenly over the ep ranks, (ep - 1) / ep of
    each leaves the rank (what a skewed router sends more is not counted: bench/moe.py
    measures it). Under tp every tp rank routes the whole (gathered) sequence."""
    counts = setup.counts
    copies = microbatch * setup.seq_len / setup.cp * counts.top_k
    passes = 2 + setup.activation_checkpointing  # forward, backward, recomputed forward
    out_bytes = counts.moe_input_bytes if setup.precision == "fp32" else 2
    per_copy = counts.d_model * (counts.moe_input_bytes + out_bytes)
    return passes * copies * per_copy * _ring(setup.ep)


def largest_microbatch(setup: Setup, device_memory: float, limit: int = 1 << 16) -> int:
    """The largest microbatch whose plan fits `device_memory` bytes; 0 if not even one does."""
    if plan_memory(setup, 1).total > device_memory:
        return 0
    low, high = 1, 2
    while high <= limit and plan_memory(setup, high).total <= device_memory:
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:  # plan(low) fits, plan(high) does not
        mid = (low + high) // 2
        low, high = (mid, high) if plan_memory(setup, mid).total <= device_memory else (low, mid)
    return low


def step_seconds(
    flops_per_token: int,
    global_batch: int,
    seq_len: int,
    world_size: int,
    peak: float,
    mfu: float,
    bubble: float = 0.0,
) -> float:
    """Seconds per optimizer step when each device runs at `mfu` of its `peak` flop/s while
    busy, and idles the pipeline's `bubble` fraction of the step."""
    if not 0 < mfu <= 1:
        raise UserError(f"mfu must be in (0, 1], got {mfu}")
    return flops_per_token * global_batch * seq_len / world_size / (peak * mfu) / (1 - bubble)


@dataclass(frozen=True)
class MeshChoice:
    """A mesh that fits: its setup, the largest microbatch that fits it, the microbatch the step
    is planned at (that one without a pipeline; 1 with one, the most microbatches and the least
    bubble) and the bubble fraction."""

    setup: Setup
    largest_microbatch: int
    microbatch: int
    bubble: float


def recommend(setup: Setup, device_memory: float) -> MeshChoice | None:
    """The smallest mesh of `setup.world_size` devices that fits `device_memory`: the fewest
    model-parallel ways tp * cp * pp, then the least pipeline bubble (the fastest step), then
    the fewest bytes sent per step (so, for long sequences, context parallelism's key/value
    gathers over tensor parallelism's activation collectives), then the larger tp (within a
    node: tp <= gpus_per_node; pp and cp may span nodes); None if none fits. Only meshes
    training takes are tried (`Setup` refuses the rest with training's checks).
    `setup.global_batch` must be set (the data-parallel ranks must divide it); its strategy,
    schedule and checkpointing are kept, its tp, cp, pp and dp layout are searched."""
    if setup.schedule not in PIPELINE_SCHEDULES:
        raise UserError(
            f"--recommend plans meshes training takes, and training runs no {setup.schedule} "
            f"schedule yet: use --schedule {' or '.join(PIPELINE_SCHEDULES)}"
        )
    choices = []
    for mesh in _meshes(setup):
        dp = mesh.dp_size
        if setup.global_batch % dp:
            continue
        fits = largest_microbatch(mesh, device_memory, limit=setup.global_batch // dp)
        if not fits:
            continue
        microbatch = fits if mesh.pp == 1 else 1
        bubble = bubble_fraction(mesh.pp, mesh.microbatches(microbatch), mesh.schedule,
                                 mesh.stages_per_rank)  # fmt: skip
        sent = plan_communication(mesh, microbatch).total
        key = (mesh.model_ways, bubble, sent, -mesh.tp, mesh.ep)
        choices.append((key, MeshChoice(mesh, fits, microbatch, bubble)))
    return min(choices, key=lambda c: c[0])[1] if choices else None


def _meshes(setup: Setup) -> list[Setup]:
    """Every tp x cp x pp layout of `setup.world_size` devices that training takes (tp within
    a node), the data-parallel rest in `setup.dp_replicate` replicas of shards; for a model
    with experts under FSDP, each with every ep (a divisor of the experts per block and of
    dp_shard x cp) as well."""
    world, meshes = setup.world_size, []
    v = setup.stages_per_rank if setup.schedule == "interleaved" else 1
    moe = setup.counts.moe and setup.strategy == "fsdp"
    for tp in _divisors(math.gcd(world, setup.gpus_per_node)):
        for cp in _divisors(world // tp):
            for pp in _divisors(world // (tp * cp)):
                if v > 1 and pp == 1:
                    continue
                eps = _divisors(math.gcd(setup.counts.n_experts, world)) if moe else [1]
                for ep in eps:
                    try:
                        mesh = dataclasses.replace(setup, tp=tp, cp=cp, pp=pp, ep=ep, dp_shard=-1)
                    except UserError:
                        continue
                    meshes.append(mesh)
    return meshes


def device_counts(gpus_per_node: int, limit: int) -> list[int]:
    """The device counts `smallest_fit` tries: powers of two up to a node, then whole nodes."""
    small = [2**k for k in range(gpus_per_node.bit_length()) if 2**k < gpus_per_node]
    return small + list(range(gpus_per_node, limit + 1, gpus_per_node))


def smallest_fit(setup: Setup, device_memory: float, limit: int = 16384) -> MeshChoice | None:
    """The recommended mesh (`recommend`) at the fewest devices (`device_counts`) that fit."""
    for world in device_counts(setup.gpus_per_node, limit):
        choice = recommend(dataclasses.replace(setup, world_size=world), device_memory)
        if choice is not None:
            return choice
    return None
