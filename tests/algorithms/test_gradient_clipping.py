import pytest
import torch

from llmfoundry.algorithms import GradientClipping
from llmfoundry.trainer import Event

from .helpers import At, Metrics, make_trainer


def grads(state):
    return [p.grad.detach().clone() for p in state.model.parameters() if p.grad is not None]


def run_with_probes(tmp_path, clipping):
    """Probe listed after the algorithm runs before it on AFTER_TRAIN_BATCH (reverse order)."""
    raw, clipped, metrics = [], [], Metrics()
    make_trainer(
        tmp_path,
        algorithms=[
            At(Event.AFTER_TRAIN_BATCH, lambda s: clipped.append(grads(s))),
            clipping,
            At(Event.AFTER_TRAIN_BATCH, lambda s: raw.append(grads(s))),
        ],
        loggers=[metrics],
    ).fit()
    return raw, clipped, metrics


def total_norm(tensors):
    return torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(t) for t in tensors])
    ).item()


def test_norm_clipping_scales_to_the_threshold_and_logs_the_raw_norm(tmp_path):
    raw, clipped, metrics = run_with_probes(tmp_path, GradientClipping("norm", threshold=0.05))
    raw_norms = [total_norm(g) for g in raw]
    assert min(raw_norms) > 0.05  # every step really is clipped
    for before, after in zip(raw, clipped, strict=True):
        assert total_norm(after) == pytest.approx(0.05, rel=1e-4)
        for b, a in zip(before, after, strict=True):  # same direction
            torch.testing.assert_close(a, b * (0.05 / total_norm(before)), rtol=1e-4, atol=1e-8)
    assert metrics.values("grad/norm") == pytest.approx(raw_norms, rel=1e-5)


def test_norm_clipping_leaves_small_gradients_alone(tmp_path):
    raw, clipped, _ = run_with_probes(tmp_path, GradientClipping("norm", threshold=1e6))
    for before, after in zip(raw, clipped, strict=True):
        for b, a in zip(before, after, strict=True):
            torch.testing.assert_close(a, b)


def test_value_clipping_clamps_each_element(tmp_path):
    raw, clipped, _ = run_with_probes(tmp_path, GradientClipping("value", threshold=0.01))
    assert max(g.abs().max().item() for step in raw for g in step) > 0.01
    for before, after in zip(raw, clipped, strict=True):
        for b, a in zip(before, after, strict=True):
            torch.testing.assert_close(a, b.clamp(-0.01, 0.01))


@pytest.mark.parametrize(
    "kwargs,message",
    [({"clipping_type": "l1"}, "'norm' or 'value'"), ({"threshold": 0}, "positive")],
)
def test_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GradientClipping(**kwargs)
