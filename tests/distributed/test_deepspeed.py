"""DeepSpeed ZeRO 1-3 with two processes (gloo, CPU, fp32): the same global batch gives the same
losses as one process (tolerance and why: test_fsdp.py), and close ones in amp_bf16 and amp_fp16
(each computed in its dtype, fp16 scaled by DeepSpeed's loss scaler alone); a ZeRO-3 checkpoint
(DeepSpeed's own plus our trainer state) resumes exactly, read without unpickling code (a payload
in it is refused); a diverged ZeRO-3 run saves no NaN checkpoint."""

import importlib.util
import re
from types import SimpleNamespace

import pytest
import torch

from llmfoundry.distributed import DeepSpeed, SingleDevice
from tests.checkpoint.helpers import write_mds

from .sharded_worker import STOP_AT, deepspeed_rank_main, resume_run
from .test_fsdp import RTOL, single_reference, spawn
from .test_fsdp_checkpoints import assert_save_refused

# find_spec, not importorskip: importing DeepSpeed here would cost seconds for nothing.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="the deepspeed strategies need pip install 'llmfoundry[deepspeed]'",
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("deepspeed")
    mds = str(write_mds(out / "mds", {"train": 32}))
    reference = single_reference(out)
    straight = resume_run(SingleDevice("cpu"), mds, str(out / "single_straight"))
    resume_run(SingleDevice("cpu"), mds, str(out / "single_saved"), stop_at=STOP_AT)
    ranks = spawn(deepspeed_rank_main, out, mds, n_ports=1)
    return out, reference, ranks, straight


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_gives_the_losses_of_one_process(runs, stage):
    _, reference, ranks, _ = runs
    for rank in ranks:
        assert rank[f"zero{stage}"]["losses"] == pytest.approx(reference.losses, rel=RTOL)


@pytest.mark.parametrize("stage", [2, 3])
def test_amp_bf16_autocasts_inside_the_engine_over_fp32_weights(runs, stage):
    # DeepSpeed 0.17.6+ turns off an autocast entered outside its engine unless its config's
    # torch_autocast section enables one: without it a GPU computed this in fp32 (the worker
    # lets DeepSpeed see the CPU's autocast as it sees CUDA's: `autocast_seen_as_on_cuda`).
    _, reference, ranks, _ = runs
    for rank in ranks:
        run = rank[f"zero{stage}_amp_bf16"]
        assert run["error"] == ""
        assert run["outputs"] == ["torch.bfloat16"] and run["weights"] == ["torch.float32"]
        # bf16 keeps 8 bits of mantissa (test_fsdp.py's bf16 test): close, not equal.
        assert run["losses"] == pytest.approx(reference.losses, rel=2e-2)
        assert run["losses"] != pytest.approx(reference.losses, rel=RTOL)


@pytest.mark.parametrize("stage", [2, 3])
def test_amp_fp16_trains_with_deepspeeds_loss_scaler_alone(runs, stage):
    # Before, the trainer unscaled gradients with a GradScaler that never scaled the loss
    # (DeepSpeed runs backward): AssertionError at the first step.
    _, reference, ranks, _ = runs
    for rank in ranks:
        run = rank[f"zero{stage}_amp_fp16"]
        assert run["error"] == ""
        assert run["outputs"] == ["torch.float16"] and run["weights"] == ["torch.float16"]
        assert run["scales"]["deepspeed"] > 1 and run["scales"]["trainer"] == {}
        assert run["losses"] == pytest.approx(reference.losses, rel=2e-2)


def test_no_kernel_is_compiled_for_training(runs):
    # Compiling DeepSpeed's shared-memory all-reduce took 230 s on a loaded 2-core machine, and
    # a killed build's lock file hung every later run; training never calls it.
    _, _, ranks, _ = runs
    assert [rank["comm"]["shm_kernel"] for rank in ranks] == [False, False]


def test_zero3_checkpoint_resumes_the_same_run(runs):
    _, _, ranks, _ = runs
    for rank in ranks:
        assert len(rank["zero3_resumed"]["losses"]) == len(rank["zero3_straight"]["losses"]) - 2
        assert rank["zero3_resumed"]["losses"] == pytest.approx(
            rank["zero3_straight"]["losses"][STOP_AT:], rel=RTOL
        )
        assert rank["zero3_resumed"]["ids"] == rank["zero3_straight"]["ids"][STOP_AT:]


def test_a_payload_in_a_deepspeed_checkpoint_is_refused_and_never_runs(runs):
    """DeepSpeed loads its files with weights_only=False; `checkpoint.deepspeed.load_shards` does not."""
    out, _, ranks, _ = runs
    for rank in ranks:
        message = rank["zero3_forged"]["error"]
        assert message.startswith(f"CheckpointError: refusing to load {out}/zero3_forged/"), message
        assert "_model_states.pt: it holds objects that loading refuses to unpickle" in message
        assert "GLOBAL posix.system" in message and "\n" not in message
    assert not (out / "payload-ran").exists()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("cut", r"cannot read \S+/zero_pp_rank_1_mp_rank_00_optim_states\.pt \(\w+: .*\): the "),
        ("junk", r"cannot read \S+/zero_pp_rank_0_mp_rank_00_model_states\.pt \(\w+: .*\): the "),
        ("lost", r"\S+/zero_pp_rank_1_mp_rank_00_model_states\.pt is missing: the checkpoint "),
    ],
)
def test_a_damaged_deepspeed_checkpoint_is_one_line_naming_the_file_on_every_rank(
    runs, damage, message
):
    """Damaged before its manifest was written (so the manifest vouches for it): the engine's
    own reading raised on the rank whose file failed ("its shards do not fit this model") while
    the other waited in a collective until timeout_s."""
    out, _, ranks, _ = runs
    errors = {rank[f"zero3_{damage}"]["error"] for rank in ranks}
    assert len(errors) == 1, errors  # every rank alike
    error = errors.pop()
    assert error.startswith(f"CheckpointError: {out}/zero3_{damage}/") or error.startswith(
        f"CheckpointError: cannot read {out}/zero3_{damage}/"
    ), error
    assert re.search(message, error) and "\n" not in error, error
    assert "load an earlier checkpoint" in error


def test_a_corrupt_deepspeed_file_found_by_one_rank_stops_every_rank(runs):
    """A byte flipped after the save: the rank whose share of the files holds it names it
    (`read_checkpoint` shares the hashing out), and every rank stops with its line instead of
    waiting for it in the engine's collectives (`read_checkpoint_together`)."""
    out, _, ranks, _ = runs
    errors = {rank["zero3_flipped"]["error"] for rank in ranks}
    assert len(errors) == 1, errors  # every rank alike
    error = errors.pop()
    name = f"zero3_flipped/ep0-ba{STOP_AT}/sharded/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    assert error.startswith("CheckpointError: file://") and f"{out}/{name} is corrupt" in error


def test_full_checkpoint_weights_load_into_zero3(runs):
    _, _, ranks, straight = runs
    # The first step after loading runs on the loaded weights alone (the optimizer starts
    # afresh), so its loss is the one-process run's at that step.
    first = ranks[0]["zero3_from_single"]["losses"][0]
    assert first == pytest.approx(straight.losses[STOP_AT], rel=RTOL)


def test_a_diverged_zero3_run_saves_nothing_and_keeps_its_good_checkpoints(runs):
    # Only rank 1's ZeRO-3 partition of a weight is NaN (the parameter itself is a placeholder).
    out, _, ranks, _ = runs
    assert_save_refused(ranks, "zero3_diverged", str(out / "zero3_diverged"))


def test_deepspeed_config_is_built_from_ours(monkeypatch):
    for key, value in dict(
        RANK="0", WORLD_SIZE="4", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1"
    ).items():
        monkeypatch.setenv(key, value)
    strategy = DeepSpeed(3, "cpu", gradient_clipping=1.0, offload_params=True)
    config = strategy.deepspeed_config("fp32")
    assert config["zero_optimization"] == {"stage": 3, "offload_param": {"device": "cpu"}}
    assert config["gradient_clipping"] == 1.0
    assert config["train_batch_size"] == 4 and config["gradient_accumulation_steps"] == 1
    assert "fp16" not in config and "torch_autocast" not in config
    bf16 = strategy.deepspeed_config("amp_bf16")["torch_autocast"]
    assert bf16 == {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    assert strategy.deepspeed_config("amp_fp16")["fp16"] == {"enabled": True}
    with pytest.raises(ValueError, match="offload_params needs ZeRO stage 3"):
        DeepSpeed(2, "cpu", offload_params=True)
    with pytest.raises(ValueError, match="stages are 1, 2 and 3"):
        DeepSpeed(4, "cpu")
    with pytest.raises(ValueError, match="auto is not supported with strategy=deepspeed_zero2"):
        DeepSpeed(2, "cpu").guard_collectives(torch.nn.Linear(1, 1))


@pytest.mark.parametrize(
    ("stage", "world", "message"),
    [
        (3, 4, r"holds DeepSpeed partitions of 2 ranks, this run has 4: .* run 2 processes"),
        (3, 1, r"holds DeepSpeed partitions of 2 ranks, this run has 1: "),
        (2, 2, r"/mp_rank_00_model_states\.pt is missing: .* or another ZeRO stage saved it"),
    ],
)
def test_deepspeed_files_of_another_world_size_or_stage_are_refused_before_reading(
    tmp_path, stage, world, message
):
    """What the engine would read but a ZeRO-3 checkpoint of two ranks does not hold (the
    files are empty: they are refused by name, before any is read)."""
    from llmfoundry.checkpoint.deepspeed import check_files
    from llmfoundry.checkpoint.manifest import CheckpointError

    for rank in range(2):
        for kind in ("optim", "model"):
            (tmp_path / f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt").touch()
    strategy = SimpleNamespace(stage=stage, world_size=world)
    with pytest.raises(CheckpointError, match=message) as err:
        check_files(strategy, tmp_path)
    assert "\n" not in str(err.value)
