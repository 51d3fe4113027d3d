import pytest

from llmfoundry.core.time import Time, Timestamp, TimeUnit


@pytest.mark.parametrize(
    "text,value,unit",
    [
        ("100ba", 100, TimeUnit.BATCH),
        ("1ep", 1, TimeUnit.EPOCH),
        ("2000000tok", 2_000_000, TimeUnit.TOKEN),
        ("500sp", 500, TimeUnit.SAMPLE),
        ("0.5dur", 0.5, TimeUnit.DURATION),
        ("2e6tok", 2_000_000, TimeUnit.TOKEN),
        (" 10 ba ", 10, TimeUnit.BATCH),
        ("30s", 30, TimeUnit.SECOND),
        ("2min", 120, TimeUnit.SECOND),
        ("1.5h", 5400, TimeUnit.SECOND),
    ],
)
def test_parse(text, value, unit):
    time = Time.parse(text)
    assert (time.value, time.unit) == (value, unit)
    assert type(time.value) is (int if unit not in (TimeUnit.DURATION, TimeUnit.SECOND) else float)


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("100", "use a number and a unit"),
        ("10xy", "unknown time unit 'xy'"),
        ("1.5ba", "whole numbers"),
        ("-1ba", "use a number and a unit"),
        ("", "use a number"),
    ],
)
def test_parse_errors(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        Time.parse(text)


def test_timestamp_counts_total_and_in_epoch():
    ts = Timestamp()
    ts.after_batch(samples=8, tokens=64, seconds=0.5)
    ts.after_batch(samples=8, tokens=64, seconds=0.5)
    ts.after_epoch()
    ts.after_batch(samples=4, tokens=32, seconds=1.0)
    assert (ts.epoch, ts.batch, ts.sample, ts.token) == (1, 3, 20, 160)
    assert (ts.batch_in_epoch, ts.sample_in_epoch, ts.token_in_epoch) == (1, 4, 32)
    assert ts.wall_clock == 2.0
    restored = Timestamp()
    restored.load_state_dict(ts.state_dict())
    assert restored == ts


@pytest.mark.parametrize(
    "text,value,unit",
    [
        ("4_000tok", 4000, TimeUnit.TOKEN),
        ("1_000_000sp", 1_000_000, TimeUnit.SAMPLE),
        ("1h30m", 5400, TimeUnit.SECOND),
        ("1h30min", 5400, TimeUnit.SECOND),
        ("2d12h", 216_000, TimeUnit.SECOND),
        ("1m30s", 90, TimeUnit.SECOND),
        ("45m", 2700, TimeUnit.SECOND),
        ("1.5h15m", 6300, TimeUnit.SECOND),
    ],
)
def test_parse_underscores_and_compound_wall_clock(text, value, unit):
    time = Time.parse(text)
    assert (time.value, time.unit) == (value, unit)


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("1h30ba", "wall-clock"),
        ("30m1h", "largest unit first"),
        ("1h1h", "largest unit first"),
        ("4__000tok", "use a number and a unit"),
        ("_4tok", "use a number and a unit"),
    ],
)
def test_parse_compound_errors(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        Time.parse(text)
