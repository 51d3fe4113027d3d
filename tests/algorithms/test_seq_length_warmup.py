import pytest
import torch

from llmfoundry.algorithms import SeqLengthWarmup
from llmfoundry.trainer import Event
from tests.trainer.conftest import token_batches

from .helpers import At, Metrics, make_trainer


def with_sequence_ids(batches):
    for batch in batches:
        batch["sequence_id"] = (
            (torch.arange(16) >= 6).long().expand(batch["input_ids"].shape).clone()
        )
    return batches


def test_length_grows_in_steps_and_token_counts_follow(tmp_path):
    originals = with_sequence_ids(token_batches(6, 2))
    seen, metrics = [], Metrics()
    warmup = SeqLengthWarmup(duration="4ba", min_seq_len=4, step_size=4)
    state = make_trainer(
        tmp_path,
        batches=[dict(b) for b in originals],
        algorithms=[warmup, At(Event.BEFORE_TRAIN_BATCH, lambda s: seen.append(dict(s.batch)))],
        loggers=[metrics],
    ).fit()
    # 16 tokens, from 4 over 4 batches: 4 + floor(12 * progress / 4) * 4, then the full length.
    lengths = [batch["input_ids"].shape[1] for batch in seen]
    assert lengths == [4, 4, 8, 12, 16, 16]
    assert metrics.values("algorithms/seq_length") == lengths
    for batch, original in zip(seen, originals, strict=True):
        length = batch["input_ids"].shape[1]
        for key in ("input_ids", "labels", "sequence_id"):
            assert torch.equal(batch[key], original[key][:, :length]), key
    # The timestamp counts the tokens trained on, not the tokens loaded.
    assert state.timestamp.token == 2 * sum(lengths)


def test_token_duration_counts_trained_tokens(tmp_path):
    # Warmup over 64 trained tokens; batches of 2 x 16 tokens, from a length of 8.
    warmup = SeqLengthWarmup(duration="64tok", min_seq_len=8, step_size=1)
    seen = []
    make_trainer(
        tmp_path,
        batches=token_batches(4, 2),
        algorithms=[
            warmup,
            At(Event.BEFORE_TRAIN_BATCH, lambda s: seen.append(s.batch["input_ids"].shape[1])),
        ],
    ).fit()
    # 0 tokens -> 8; 16 trained -> 8 + 8 * 16/64 = 10; 36 -> 12 (12.5 floored); 60 -> 15.
    assert seen == [8, 10, 12, 15]


def test_max_seq_len_caps_and_eval_batches_are_untouched(tmp_path):
    seen_eval = []
    warmup = SeqLengthWarmup(duration="1ba", min_seq_len=4, max_seq_len=12)
    trainer = make_trainer(
        tmp_path,
        batches=token_batches(3, 2),
        eval_dataloaders={"v": token_batches(1, 2)},
        algorithms=[
            warmup,
            At(Event.EVAL_BATCH_START, lambda s: seen_eval.append(s.batch["input_ids"].shape[1])),
        ],
    )
    assert warmup.length(trainer.state, 16) == 4
    trainer.state.timestamp.batch = 1
    assert warmup.length(trainer.state, 16) == 12 and warmup.length(trainer.state, 10) == 10
    trainer.state.timestamp.batch = 0
    trainer.fit()
    assert seen_eval == [16]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"duration": "0ba"}, "duration must be positive"),
        ({"min_seq_len": 1}, "min_seq_len must be >= 2"),
        ({"min_seq_len": 16, "max_seq_len": 8}, "below min_seq_len"),
        ({"step_size": 0}, "step_size must be >= 1"),
    ],
)
def test_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SeqLengthWarmup(**kwargs)
