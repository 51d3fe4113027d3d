"""Pipeline parallelism composed with FSDP2 and with tensor parallelism, four processes (gloo,
CPU, fp32): two stages of the tiny MPT, each sharded over two processes, give the one-process
losses for the same global batch under both schedules, initialize as one process does, and a
checkpoint saved at pp=2 x dp=2 resumes at dp=4 and in one process, continuing the same sample
order; Llama's two stages (untied head), sharded or split by tp=2, give its one-process losses,
and so do MPT's split by tp=2.

Tolerance: relative 1e-5 on losses, as test_fsdp.py's and for the same reason: the same fp32
math summed in another order (the tied embedding's gradient is the sum of the first stage's
embedding gradient and the last stage's head gradient instead of one accumulation; each data
-parallel half of the batch is reduced by a reduce-scatter), which moves losses by about 1e-7
relative over three AdamW steps (measured: 1.2e-7 at most). Any real error is far larger: an
unsummed tied gradient moved the second loss by 2e-4, a microbatch weighted wrongly or a stage
skipped by 1e-3 or more.
"""

import re
import shutil
import signal
from pathlib import Path

import pytest
import torch

from llmfoundry.algorithms import GradientClipping
from llmfoundry.checkpoint import read_latest
from llmfoundry.distributed import SingleDevice
from llmfoundry.distributed.pipeline import Pipeline, even_microbatches, stage_blocks
from llmfoundry.models import parallel_plan
from llmfoundry.models.plan import ParallelPlan
from llmfoundry.trainer import Trainer
from llmfoundry.utils.errors import UserError
from tests.checkpoint.helpers import write_mds
from tests.trainer.conftest import tiny_model

from .pipeline_worker import (
    CLIP,
    CRASHED,
    DAMAGED,
    KILL_AT,
    PARITY,
    RESUMED_BY_PP,
    TP_X_PP,
    WORLD,
    StageWeights,
    crashed_rank_main,
    damaged_rank_main,
    rank_main,
    resumed_rank_main,
)
from .sharded_worker import RESUME_BATCHES, STOP_AT, parity_run, resume_run, tiny_llama
from .spawn import free_port, run_ranks
from .test_fsdp_checkpoints import shard_tensors
from .workers import global_batches, uneven_eval_set

LIMIT_S, RTOL = 600, 1e-5


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    """The folder of the `runs` spawn's runs and checkpoints."""
    return tmp_path_factory.mktemp("pipeline")


@pytest.fixture(scope="module")
def runs(out):
    """One-process references, then one spawn of four ranks running every pipeline case."""
    mds = str(write_mds(out / "mds", {"train": 32}))
    weights = StageWeights()
    everything = {"train": global_batches(), "uneven": uneven_eval_set(0, 1)}
    single = {
        "parity": parity_run(
            SingleDevice("cpu"), 0, 1, callbacks=[weights], eval_dataloaders=everything
        ),
        "clipped": parity_run(
            SingleDevice("cpu"), 0, 1, algorithms=[GradientClipping(threshold=CLIP)]
        ),
        "llama": parity_run(SingleDevice("cpu"), 0, 1, model=tiny_llama()),
        **{
            f"tp_{family}": parity_run(
                SingleDevice("cpu"), 0, 1, model=build(), eval_dataloaders=everything
            )
            for family, build in TP_X_PP.items()
        },
        "straight": resume_run(
            SingleDevice("cpu"), mds, str(out / "single_straight"), save_interval=f"{STOP_AT}ba"
        ),
    }
    ports = [free_port() for _ in range(len(PARITY) + len(TP_X_PP) + 4 + len(RESUMED_BY_PP))]
    run_ranks(rank_main, WORLD, ports, str(out), mds, limit_s=LIMIT_S)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    single["single_from_pp"] = resume_run(
        SingleDevice("cpu"), mds, str(out / "single_from_pp"), load=str(out / "pp2_fsdp2_saved")
    )
    return single, weights.initial, ranks


@pytest.mark.parametrize("name", PARITY)
def test_fsdp_x_pp_gives_the_one_process_losses_on_every_rank(runs, name):
    single, _, ranks = runs
    reference = single["parity"].losses
    assert len(reference) == 3
    for rank in ranks:  # every stage reports the last stage's loss
        assert rank[name]["losses"] == pytest.approx(reference, rel=RTOL), name


@pytest.mark.parametrize("name", PARITY)
def test_evaluation_through_the_stages_gives_the_one_process_metrics(runs, name):
    """Forward-only through the stages; the last stage's totals reach every stage. The
    "uneven" set's batches (5 and 3 rows, halved by dp=2) are not a multiple of pp: each is
    split into as many equal microbatches as divide it."""
    single, _, ranks = runs
    reference = single["parity"].eval_metrics
    assert set(reference) == {
        f"eval/{split}/{k}"
        for split in ("train", "uneven")
        for k in ("loss", "perplexity", "accuracy")
    }
    for rank in ranks:
        assert rank[name]["eval"] == pytest.approx(reference, rel=RTOL), name


def test_llama_with_its_untied_head_gives_the_one_process_losses(runs):
    single, _, ranks = runs
    assert single["llama"].losses != pytest.approx(single["parity"].losses, rel=1e-3)
    for rank in ranks:
        assert rank["llama_pp2_fsdp2"]["losses"] == pytest.approx(single["llama"].losses, rel=RTOL)


@pytest.mark.parametrize("family", TP_X_PP)
def test_tp_x_pp_gives_the_one_process_losses(runs, family):
    """tp=2 x pp=2 (no data parallelism): each stage's blocks split over two processes, the
    stages passing sequence-split activations, four microbatches through 1F1B; evaluated on
    batches pp divides and on batches of 5 and 3 rows, which it does not."""
    single, _, ranks = runs
    reference = single[f"tp_{family}"]
    for rank in ranks:
        assert rank[f"{family}_tp2_pp2"]["losses"] == pytest.approx(reference.losses, rel=RTOL)
        assert rank[f"{family}_tp2_pp2"]["eval"] == pytest.approx(reference.eval_metrics, rel=RTOL)


def test_gradient_clipping_takes_the_norm_over_every_stage(runs):
    single, _, ranks = runs
    clipped = single["clipped"].losses
    assert clipped != pytest.approx(single["parity"].losses, rel=1e-3)  # the clipping binds
    for rank in ranks:
        assert rank["pp2_fsdp2_clipped"]["losses"] == pytest.approx(clipped, rel=RTOL)


def test_stages_hold_their_blocks_and_initialize_as_one_process(runs):
    _, initial, ranks = runs
    # Ranks 0, 1 are the first stage (its two shards), 2, 3 the last.
    first, last = ranks[0]["pp2_fsdp2_1f1b"]["initial"], ranks[2]["pp2_fsdp2_1f1b"]["initial"]
    assert {n.split(".")[2] for n in first if ".blocks." in n} == {"0"}
    assert {n.split(".")[2] for n in last if ".blocks." in n} == {"1"}
    assert "transformer.norm_f.weight" in last and "transformer.norm_f.weight" not in first
    # The tied embedding and head: both end stages hold it, initialized alike.
    assert torch.equal(first["transformer.wte.weight"], last["transformer.wte.weight"])
    assert {**first, **last}.keys() == initial.keys()
    for name, value in {**first, **last}.items():
        assert torch.equal(value, initial[name]), name


@pytest.mark.parametrize("resumed", ["fsdp4_from_pp2", "single_from_pp"])
def test_checkpoint_saved_at_pp2_x_dp2_resumes_at_dp4_and_one_process(runs, resumed):
    """And the other way: test_a_whole_checkpoint_resumes_at_pp2."""
    single, _, ranks = runs
    straight = single["straight"]
    assert ranks[0]["pp2_fsdp2_saved"]["losses"] == pytest.approx(
        straight.losses[:STOP_AT], rel=RTOL
    )
    if resumed == "single_from_pp":
        losses, ids = single[resumed].losses, single[resumed].ids
    else:
        losses = ranks[0][resumed]["losses"]
        ids = [sum(step, []) for step in zip(*(r[resumed]["ids"] for r in ranks), strict=True)]
    assert len(losses) == RESUME_BATCHES - STOP_AT
    assert losses == pytest.approx(straight.losses[STOP_AT:], rel=RTOL)
    assert [sorted(i) for i in ids] == [sorted(i) for i in straight.ids[STOP_AT:]]


def final_shards(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the latest checkpoint in `folder` (weights and optimizer state), whole."""
    return shard_tensors(folder / read_latest(str(folder)))


def assert_bitwise(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    assert any(k.startswith("optimizer.state.") for k in got)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_a_pipeline_run_resumes_from_its_own_checkpoint_bitwise(runs, out):
    """Saved at pp=2 x dp=2 after STOP_AT and resumed by the same layout, it goes on as the run
    that did not stop: the same losses and samples, the same final weights and optimizer state
    (before issue 32 the last stage's ranks lost their optimizer groups: KeyError 'initial_lr')."""
    _, _, ranks = runs
    for rank in ranks:
        straight, resumed = rank["pp2_fsdp2_straight"], rank["pp2_from_pp2"]
        assert len(straight["losses"]) == RESUME_BATCHES
        assert rank["pp2_fsdp2_saved"]["losses"] == straight["losses"][:STOP_AT]
        assert resumed["losses"] == straight["losses"][STOP_AT:]
        assert resumed["ids"] == straight["ids"][STOP_AT:]
    assert_bitwise(final_shards(out / "pp2_from_pp2"), final_shards(out / "pp2_fsdp2_straight"))


def test_a_whole_checkpoint_resumes_at_pp2(runs):
    """A one-process run's whole checkpoint (weights and optimizer state of every parameter,
    by name) resumed at pp=2 x dp=2: each stage takes its own parameters' (before, the other
    stages' weights were refused as unexpected keys), and the losses go on as one process's."""
    single, _, ranks = runs
    straight = single["straight"]
    for rank in ranks:
        losses = rank["pp2_from_single"]["losses"]
        assert len(losses) == RESUME_BATCHES - STOP_AT
        assert losses == pytest.approx(straight.losses[STOP_AT:], rel=RTOL)


@pytest.fixture(scope="module")
def crashes(tmp_path_factory) -> Path:
    """Each CRASHED run killed by SIGKILL after batch KILL_AT (its last checkpoint at batch 2),
    one spawn each; then one spawn resuming them and running them uninterrupted."""
    out = tmp_path_factory.mktemp("pipeline_crashes")
    mds = str(write_mds(out / "mds", {"train": 32}))
    for name in CRASHED:
        exit_codes = run_ranks(
            crashed_rank_main, WORLD, free_port(), str(out), mds, name, limit_s=LIMIT_S,
            killed=True,
        )  # fmt: skip
        assert exit_codes == [-signal.SIGKILL] * WORLD, name
        assert read_latest(str(out / f"{name}_crashed")) == "ep0-ba2", name
    ports = [free_port() for _ in range(2 * len(CRASHED))]
    run_ranks(resumed_rank_main, WORLD, ports, str(out), mds, limit_s=LIMIT_S)
    return out


def flip_a_byte(path: Path) -> None:
    """Same size, other bytes: only hashing the file finds it (one rank hashes each file)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# How each DAMAGED copy is damaged, and what every rank of its resume must say.
DAMAGE = {
    "shard_flipped": lambda c: flip_a_byte(c / "sharded" / "__1_0.distcp"),
    "rng_flipped": lambda c: flip_a_byte(c / "rng-rank3.pt"),  # read by rank 3 alone
    "metadata_truncated": lambda c: (c / "sharded" / ".metadata").write_bytes(b"\x80"),
    "manifest_deleted": lambda c: (c / "manifest.json").unlink(),
}
DAMAGE_SAID = {
    "shard_flipped": r"CheckpointError: \S+/ep0-ba2/sharded/__1_0\.distcp is corrupt: .*; load an "
    "earlier checkpoint$",
    "rng_flipped": r"CheckpointError: \S+/ep0-ba2/rng-rank3\.pt is corrupt: .*; load an earlier "
    "checkpoint$",
    "metadata_truncated": r"CheckpointError: load_path \S+ holds no complete checkpoint: its "
    r"newest, \S+/ep0-ba2, is incomplete: sharded/\.metadata \(1 bytes, the manifest says \d+\)"
    "; copy that checkpoint again",
    "manifest_deleted": r"CheckpointError: load_path \S+ holds no complete checkpoint: its "
    r"newest, \S+/ep0-ba2, has no manifest\.json: its save was cut short",
}


@pytest.fixture(scope="module")
def damaged(runs, out) -> list[dict[str, str]]:
    """Copies of the pp2 run saved after STOP_AT, each damaged as DAMAGE says, then one spawn
    resuming each: the error every rank ended with, by damage."""
    assert DAMAGE.keys() == set(DAMAGED)
    for damage, spoil in DAMAGE.items():
        copy = out / f"damaged_{damage}"
        shutil.copytree(out / "pp2_fsdp2_saved", copy)
        spoil(copy / f"ep0-ba{STOP_AT}")
    ports = [free_port() for _ in DAMAGED]
    run_ranks(damaged_rank_main, WORLD, ports, str(out), str(out / "mds"), limit_s=LIMIT_S)
    return [torch.load(out / f"damaged_rank{r}.pt", weights_only=True) for r in range(WORLD)]


@pytest.mark.parametrize("damage", DAMAGED)
def test_a_damaged_pipeline_checkpoint_fails_every_rank_in_one_line_naming_the_file(
    damaged, damage
):
    """Each rank hashes only its share of the files (and reads its own RNG file): a flipped
    byte failed one rank while the others waited for it in the shards' load, and ended with a
    peer's traceback ("Connection closed by peer"). Now every rank raises the same line."""
    errors = {rank[damage] for rank in damaged}
    assert len(errors) == 1, errors
    (error,) = errors
    assert re.match(DAMAGE_SAID[damage], error), error
    assert "\n" not in error


@pytest.mark.slow  # three spawns; the resume itself is test_a_pipeline_run_resumes_from_its_...
@pytest.mark.parametrize("name", CRASHED)
def test_a_pipeline_run_killed_with_sigkill_resumes_bitwise(crashes, name):
    """pp=2 x dp=2 and tp=2 x pp=2: killed after batch 3, resumed from batch 2 (as autoresume
    does, from the save folder), it redoes batch 3 and ends as the run that was not killed."""
    ranks = [torch.load(crashes / f"resumed_rank{r}.pt", weights_only=True) for r in range(WORLD)]
    for rank in ranks:
        straight, resumed = rank[f"{name}_straight"], rank[f"{name}_crashed"]
        assert len(straight["losses"]) == RESUME_BATCHES > KILL_AT
        assert resumed["losses"] == straight["losses"][2:]
        assert resumed["ids"] == straight["ids"][2:]
    assert_bitwise(
        final_shards(crashes / f"{name}_crashed"), final_shards(crashes / f"{name}_straight")
    )


def test_stages_split_the_blocks_contiguously_and_evenly():
    assert [list(stage_blocks(5, 2, s)) for s in range(2)] == [[0, 1, 2], [3, 4]]
    assert [list(stage_blocks(4, 4, s)) for s in range(4)] == [[0], [1], [2], [3]]


def test_impossible_pipeline_settings_are_refused_in_one_line():
    with pytest.raises(UserError, match="pp_schedule='nosuch'"):
        Pipeline(2, "nosuch")
    with pytest.raises(UserError, match="pp_schedule=interleaved .* not supported"):
        Pipeline(2, "interleaved")
    model = tiny_model()  # two blocks
    with pytest.raises(UserError, match="pp=3 exceeds the model's 2 blocks"):
        Pipeline(3, "1f1b").split(model, parallel_plan(model), mesh=None)
    with pytest.raises(UserError, match="has no pipeline split"):  # a family without one
        Pipeline(2, "1f1b").split(model, ParallelPlan(list(model.transformer.blocks)), mesh=None)
    with pytest.raises(UserError, match="needs at least pp=2 microbatches per step, got 1"):
        Pipeline(2, "1f1b").microbatches(4, 4)
    with pytest.raises(UserError, match="needs at least pp=2 microbatches per step, got 1"):
        Pipeline(2, "1f1b").microbatches(1, None)  # fewer samples per device than stages
    assert Pipeline(2, "1f1b").microbatches(4, 2) == 2


def test_the_default_microbatch_keeps_every_stage_busy():
    """device_train_microbatch_size=null (the default config's) under pp: the largest divisor
    of the per-device batch that makes at least pp microbatches, not one whole-batch microbatch
    (which 1F1B refuses and which leaves all stages but one idle)."""
    sizes = {(pp, rows): Pipeline(pp, "1f1b").default_microbatch_size(rows)
             for pp, rows in [(2, 4), (2, 8), (2, 3), (4, 6), (4, 8), (3, 8)]}  # fmt: skip
    assert sizes == {(2, 4): 2, (2, 8): 4, (2, 3): 1, (4, 6): 1, (4, 8): 2, (3, 8): 2}
    assert Pipeline(2, "1f1b").microbatches(4, None) == 2
    assert Pipeline(2, "gpipe").microbatches(6, None) == 2


def test_microbatches_have_equal_rows():
    """A stage's receive buffers are laid out for its first microbatch's shape, so a batch the
    microbatches do not split evenly is refused in training and split differently in
    evaluation (the rows pp does not divide, e.g. a split's last batch)."""
    with pytest.raises(UserError, match="device_train_microbatch_size=2 does not divide the 3 "):
        Pipeline(2, "gpipe").microbatches(3, 2)
    assert Pipeline(2, "gpipe").microbatches(6, 2) == 3
    assert [even_microbatches(rows, 2) for rows in (1, 2, 3, 4, 5, 6)] == [1, 2, 1, 2, 1, 2]
    assert [even_microbatches(rows, 4) for rows in (6, 8, 9, 7)] == [3, 4, 3, 1]


class _PipelineStrategy(SingleDevice):
    """A strategy that says it pipelines (the trainer refuses before joining any group)."""

    pipeline = Pipeline(2, "gpipe")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"device_train_microbatch_size": "auto"}, "device_train_microbatch_size=auto"),
        ({"precision": "amp_fp16"}, "precision=amp_fp16"),
    ],
)
def test_trainer_refuses_what_pipelining_does_not_support(tmp_path, options, message):
    with pytest.raises(UserError, match=message):
        Trainer(
            model=tiny_model(), strategy=_PipelineStrategy("cpu"), train_dataloader=[],
            max_duration="1ba", optimizer=torch.optim.SGD, run_dir=tmp_path, **options,
        )  # fmt: skip
