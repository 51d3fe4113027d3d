"""The ports the spawned process groups of the tests draw (tests/conftest.py `free_port`)."""

from tests.conftest import _port_slice, free_port


def test_free_port_never_hands_out_a_port_twice():
    """A spawn draws one port per case before any rank binds one: 300 draws from this process's
    slice (a few thousand ports) would repeat one almost surely if drawn independently."""
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)


def test_each_pytest_process_draws_from_its_own_slice(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    floor = _port_slice(20000, 32768)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    workers = []
    for name in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", name)
        workers.append(_port_slice(20000, 32768))
    bounds = sorted([floor, *workers])
    assert all(a[1] <= b[0] for a, b in zip(bounds, bounds[1:], strict=False))
