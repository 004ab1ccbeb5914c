"""Learning-rate schedules: the paper's noam exactly, the others, the cooldowns."""

import functools

import numpy as np
import pytest

from flaxformer_lite.training import schedules


@pytest.mark.parametrize("count", [0, 1, 99, 3999, 4000, 4001, 99_999])
def test_noam_is_the_papers_formula(count):
    step = count + 1  # the paper counts steps from 1
    want = 512**-0.5 * min(step**-0.5, step * 4000**-1.5)
    got = float(schedules.noam(512, 4000)(count))
    assert got == pytest.approx(want, rel=1e-6)


def test_noam_peak_and_scale():
    s = schedules.noam(512, 4000, scale=2.0)
    values = [float(s(c)) for c in range(3990, 4010)]
    assert max(values) == pytest.approx(2 * 512**-0.5 * 4000**-0.5, rel=1e-5)
    assert int(np.argmax(values)) + 3990 + 1 == 4000


def test_cooldown_factor_by_steps_is_with_cooldown():
    """With no clock the host-side factor is the in-graph cooldown of
    ``fraction * num_steps`` updates, update for update (``step`` is 1-based)."""
    ramp = schedules.with_cooldown(schedules.constant(1.0), total_steps=50, cooldown_steps=10)
    for step in range(1, 51):
        got = schedules.cooldown_factor(0.2, step, 50)
        assert got == pytest.approx(float(ramp(step - 1)), abs=1e-7), step
    assert schedules.cooldown_factor(0.2, 50, 50) == pytest.approx(0.1)
    assert schedules.cooldown_factor(0.0, 50, 50) == 1.0


def test_cooldown_factor_by_time_and_the_nearer_end():
    f = functools.partial(schedules.cooldown_factor, 0.25, num_steps=1000, budget_seconds=400.0)
    assert f(step=10, seconds_left=300.0) == 1.0  # before the last 100 s
    assert f(step=10, seconds_left=100.0) == pytest.approx(1.0)
    assert f(step=10, seconds_left=50.0) == pytest.approx(0.5)
    assert f(step=10, seconds_left=-5.0) == 0.0  # past the deadline: no update at all
    # The steps end first: their ramp wins (update 951 of 1000 has 50 of 250 left).
    assert f(step=951, seconds_left=300.0) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="cooldown fraction 1.5 must be in"):
        schedules.cooldown_factor(1.5, 1, 10)


def test_other_schedules():
    cos = schedules.warmup_cosine(1e-3, 10, 100)
    assert float(cos(0)) == 0.0 and float(cos(10)) == pytest.approx(1e-3)
    assert float(cos(100)) == pytest.approx(0.0, abs=1e-9)
    const = schedules.constant(5e-4, warmup_steps=4)
    assert float(const(2)) == pytest.approx(2.5e-4) and float(const(50)) == pytest.approx(5e-4)


def test_cooldown_scales_the_tail_linearly_to_zero():
    base = schedules.noam(256, 10)
    cooled = schedules.with_cooldown(base, total_steps=100, cooldown_steps=20)
    for count in (0, 5, 10, 50, 80):  # before the cooldown: untouched
        assert float(cooled(count)) == pytest.approx(float(base(count)), rel=1e-6)
    for count in (81, 90, 99):  # update 100 - k is scaled by k / 20
        want = float(base(count)) * (100 - count) / 20
        assert float(cooled(count)) == pytest.approx(want, rel=1e-5)
    assert float(cooled(100)) == 0.0 and float(cooled(150)) == 0.0
    assert schedules.with_cooldown(base, 100, 0) is base
    with pytest.raises(ValueError, match="cooldown_steps=101 exceeds the run's 100 updates"):
        schedules.with_cooldown(base, 100, 101)
