"""CUDA generator states in checkpoints: each process saves and restores the generator of the one
device it trains on, so a resume on a machine with another number of visible GPUs neither raises
nor moves a stream to another device. CUDA is faked (generators per device index, raising for an
index the machine lacks, as torch's do), so this runs on any machine."""

import logging

import pytest
import torch

from llmfoundry.rng import load_rng_state, rng_state


class FakeCuda:
    """`gpus` devices' generator states (a distinct byte tensor each), and torch.cuda's RNG calls
    on them: `current` is the process's current device."""

    def __init__(self, monkeypatch, gpus: int, current: int = 0) -> None:
        self.states = [torch.full((8,), 10 * i, dtype=torch.uint8) for i in range(gpus)]
        self.current = current
        cuda = torch.cuda
        for name, fake in {
            "is_available": lambda: True,
            "is_initialized": lambda: True,
            "device_count": lambda: len(self.states),
            "current_device": lambda: self.current,
            "get_rng_state": self.get,
            "set_rng_state": self.set,
            "get_rng_state_all": lambda: [s.clone() for s in self.states],
            "set_rng_state_all": lambda states: [self.set(s, i) for i, s in enumerate(states)],
        }.items():
            monkeypatch.setattr(cuda, name, fake)

    def _index(self, device) -> int:
        if isinstance(device, int):  # as torch's, these take an index or a device
            index = device
        else:
            device = torch.device(device)
            index = self.current if device.index is None else device.index
        if index >= len(self.states):  # torch: IndexError from its default_generators tuple
            raise IndexError(f"no CUDA device {index} on this machine")
        return index

    def get(self, device="cuda") -> torch.Tensor:
        return self.states[self._index(device)].clone()

    def set(self, state: torch.Tensor, device="cuda") -> None:
        self.states[self._index(device)] = state.clone()

    def draw(self, device: int) -> None:
        """Advance one device's generator (as a dropout mask drawn there would)."""
        self.states[device] = self.states[device] + 1


def test_a_resume_on_fewer_visible_gpus_restores_this_device_and_does_not_raise(monkeypatch):
    # Saved by the process on cuda:0 of a machine showing 4 GPUs (one process per GPU, each
    # seeing them all: only its own device's generator ever moved).
    saver = FakeCuda(monkeypatch, gpus=4)
    saver.draw(0)
    saved = rng_state(torch.device("cuda", 0))
    assert torch.equal(saved["cuda"], saver.states[0])
    # Resumed where the process sees one GPU (CUDA_VISIBLE_DEVICES per process, a smaller node).
    resumer = FakeCuda(monkeypatch, gpus=1)
    load_rng_state(saved, torch.device("cuda", 0))
    assert torch.equal(resumer.states[0], saver.states[0])


def test_each_rank_continues_its_own_stream_on_another_device_index(monkeypatch):
    saver = FakeCuda(monkeypatch, gpus=2)
    saver.draw(1)
    saved = rng_state(torch.device("cuda", 1))  # local rank 1
    resumer = FakeCuda(monkeypatch, gpus=1)  # the same rank, alone on its node's only GPU
    load_rng_state(saved, torch.device("cuda", 0))
    assert torch.equal(resumer.states[0], saver.states[1])


def test_the_device_without_an_index_is_the_current_one(monkeypatch):
    fake = FakeCuda(monkeypatch, gpus=2, current=1)
    fake.draw(1)
    saved = rng_state(torch.device("cuda"))
    assert torch.equal(saved["cuda"], fake.states[1])


def test_old_checkpoints_with_every_visible_gpu_give_this_device_its_entry(monkeypatch, caplog):
    old = FakeCuda(monkeypatch, gpus=4)
    for device in range(4):
        old.draw(device)
    listed = {**rng_state(torch.device("cpu")), "cuda": torch.cuda.get_rng_state_all()}
    # The same layout: local rank 2 on cuda:2 takes entry 2.
    resumed = FakeCuda(monkeypatch, gpus=4)
    load_rng_state(listed, torch.device("cuda", 2))
    assert torch.equal(resumed.states[2], listed["cuda"][2])
    assert torch.equal(resumed.states[0], torch.zeros(8, dtype=torch.uint8))  # untouched
    # Saved where the process saw one GPU: that entry is its device's, whatever index now.
    one = {**listed, "cuda": listed["cuda"][:1]}
    resumed = FakeCuda(monkeypatch, gpus=8)
    load_rng_state(one, torch.device("cuda", 5))
    assert torch.equal(resumed.states[5], listed["cuda"][0])
    # A longer list without this device's index: no entry is its own, so it stays as seeded.
    two = {**listed, "cuda": listed["cuda"][:2]}
    resumed = FakeCuda(monkeypatch, gpus=8)
    with caplog.at_level(logging.WARNING, logger="llmfoundry.rng"):
        load_rng_state(two, torch.device("cuda", 5))
    assert torch.equal(resumed.states[5], torch.full((8,), 50, dtype=torch.uint8))
    assert "cover 2 GPUs, not this process's cuda:5" in caplog.text


@pytest.mark.parametrize("saved_on", ["cpu", "cuda"])
def test_cpu_runs_save_no_cuda_state_and_a_cpu_resume_ignores_one(monkeypatch, saved_on):
    FakeCuda(monkeypatch, gpus=1)
    state = rng_state(torch.device(saved_on))
    assert ("cuda" in state) == (saved_on == "cuda")
    resumer = FakeCuda(monkeypatch, gpus=1)
    before = resumer.states[0].clone()
    load_rng_state(state, torch.device("cpu"))
    assert torch.equal(resumer.states[0], before)


@pytest.mark.cuda  # a real CUDA generator
def test_a_real_cuda_generator_continues_its_stream_from_either_format():
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.manual_seed(3)
    saved = rng_state(device)
    expected = torch.rand(4, device=device)
    torch.cuda.manual_seed(5)
    load_rng_state(saved, device)
    assert torch.equal(torch.rand(4, device=device), expected)
    # An old checkpoint's list, from a machine with more GPUs than this one: no error.
    listed = {**saved, "cuda": [saved["cuda"]] * (torch.cuda.device_count() + 1)}
    load_rng_state(listed, device)
    assert torch.equal(torch.rand(4, device=device), expected)
