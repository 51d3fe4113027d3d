import pytest

from llmfoundry.callbacks import LRMonitor
from llmfoundry.loggers import TensorBoardLogger
from tests.callbacks.conftest import make_trainer

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def test_scalars_and_hyperparameters_in_the_run_folder(tmp_path):
    config = {"run_name": "r", "optimizer": {"lr": 0.1}, "hf_token": "hf_abc"}
    trainer = make_trainer(
        tmp_path, n_batches=3, callbacks=[LRMonitor()], loggers=[TensorBoardLogger()], config=config
    )
    trainer.fit()
    files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1 and files[0].stat().st_size > 0
    events = event_accumulator.EventAccumulator(str(files[0]), size_guidance={"tensors": 0})
    events.Reload()
    loss = events.Scalars("loss/train")
    assert [e.step for e in loss] == [1, 2, 3]
    assert loss[-1].value == pytest.approx(trainer.state.train_loss)
    assert [e.step for e in events.Scalars("lr/group0")] == [1, 2, 3]
    text = events.Tensors("hyperparameters/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"lr": 0.1' in text
    assert "hf_abc" not in text and "hf_token" not in text


def test_rejects_bad_flush_interval():
    with pytest.raises(ValueError, match="flush_secs"):
        TensorBoardLogger(flush_secs=0)
