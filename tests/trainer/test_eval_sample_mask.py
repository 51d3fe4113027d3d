"""Eval results do not depend on the world size: padding samples (sample_mask False) count
nowhere, and the model never sees the mask."""

import json

import pytest
import torch

from llmfoundry.trainer import Callback
from tests.distributed.spawn import free_port, run_ranks

from .eval_worker import eval_rank, rank_batches, single_process
from .test_trainer import trainer_for


def test_two_processes_give_the_single_process_eval_metrics(tmp_path):
    run_ranks(eval_rank, 2, free_port(), str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    reference = single_process()
    assert ranks[0] == ranks[1]
    for metric in ("loss", "accuracy"):
        key = f"eval/masked/{metric}"
        assert ranks[0][key] == pytest.approx(reference[key], rel=1e-12, abs=0), key
    # Ignoring the mask counts the repeated sample twice: a different (wrong) loss.
    assert ranks[0]["eval/unmasked/loss"] != pytest.approx(reference["eval/masked/loss"], rel=1e-4)


def test_model_never_sees_the_mask_and_masked_rows_count_nowhere(tmp_path):
    class Keys(Callback):
        seen = set()

        def eval_before_forward(self, state, logger):
            self.seen |= set(state.batch)

    padded = rank_batches(0, 1)
    padded[-1] = {k: torch.cat([v, v]) for k, v in padded[-1].items()}
    padded[-1]["sample_mask"][1] = False  # the last sample again, as padding
    trainer = trainer_for(
        tmp_path,
        rank_batches(0, 1),
        eval_dataloaders={"padded": padded, "plain": rank_batches(0, 1, keep_mask=False)},
        callbacks=[Keys()],
    )
    metrics = trainer.evaluate()
    assert Keys.seen == {"input_ids", "labels"}
    for metric in ("loss", "accuracy"):
        assert metrics[f"eval/padded/{metric}"] == pytest.approx(
            metrics[f"eval/plain/{metric}"], rel=1e-12
        )


def test_a_mask_that_is_not_one_bool_per_sample_is_an_error(tmp_path):
    batches = rank_batches(0, 1)
    batches[0]["sample_mask"] = torch.ones(2, dtype=torch.long)
    trainer = trainer_for(tmp_path, rank_batches(0, 1), eval_dataloaders={"v": batches})
    with pytest.raises(ValueError, match="must be a bool tensor of shape"):
        trainer.evaluate()
