"""The end of a run: where its final checkpoints fall (by steps and by the clock),
which checkpoints `average` takes (its late window), and the outlook the log gives
(the step a budget reaches and the recipe's recorded BLEU there). Pure functions and a
fake clock: no training here (test_resume trains a run that uses them)."""

import pytest

from flaxformer_lite.config import ConfigError
from flaxformer_lite.config.experiment import TrainConfig, format_curve, parse_curve
from flaxformer_lite.inference.average import choose_steps, window_start
from flaxformer_lite.training import loop
from flaxformer_lite.training.loop import (
    Clock,
    FinalCheckpoints,
    Pace,
    expectation,
    final_fractions,
    read_curve,
)


def _clock(num_steps: int, max_minutes: float = 0.0, spent_before: float = 0.0) -> Clock:
    return Clock(
        max_minutes=max_minutes, num_steps=num_steps, every=1, cooldown_fraction=0.0,
        spent_before=spent_before, wall_start=loop.time.perf_counter(), say=print,
    )  # fmt: skip


def _saved(finals: FinalCheckpoints, num_steps: int) -> list[int]:
    return [step for step in range(1, num_steps + 1) if finals.due(step)]


def test_final_fractions_fill_the_window_and_end_at_the_end():
    assert final_fractions(4, 0.25) == [0.8125, 0.875, 0.9375, 1.0]
    assert final_fractions(1, 0.25) == [1.0]


def test_a_short_step_budget_gets_final_checkpoints_in_its_last_quarter():
    # 600 steps, a checkpoint every 200: the cadence leaves only step 600 in the last
    # quarter (450-600), so three more are written there.
    finals = FinalCheckpoints(_clock(600), count=4, window=0.25, every=200, start_step=0)
    assert finals.steps() == [488, 525, 563]
    assert _saved(finals, 600) == [488, 525, 563]


def test_a_step_budget_whose_cadence_fills_the_window_keeps_todays_checkpoints():
    finals = FinalCheckpoints(_clock(2000), count=4, window=0.25, every=100, start_step=0)
    assert finals.steps() == [] and _saved(finals, 2000) == []
    off = FinalCheckpoints(_clock(600), count=0, window=0.25, every=200, start_step=0)
    assert _saved(off, 600) == []


def test_a_resumed_run_skips_the_marks_its_earlier_commands_passed():
    finals = FinalCheckpoints(_clock(600), count=4, window=0.25, every=200, start_step=500)
    assert _saved(finals, 600) == [525, 563]


def test_a_wall_clock_budget_places_them_at_shares_of_the_step_it_will_reach(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(loop.time, "perf_counter", lambda: now[0])
    # 10 minutes, 4 of them spent by an earlier command that stopped at step 7; a step
    # cap far away. 1.5 s a step: the 6 minutes left are 240 steps, so the run ends at
    # step 247 and its marks fall at 13/16, 14/16 and 15/16 of it.
    clock = _clock(100_000, max_minutes=10, spent_before=4)
    finals = FinalCheckpoints(clock, count=4, window=0.25, every=1000, start_step=7)
    saved, projected = [], {}
    for step in range(8, 400):
        now[0] += 1.5
        projected[step] = clock.projected_steps(step, 1.5)
        if finals.due(step, None if step == 8 else 1.5):
            saved.append(step)
    assert saved == [201, 217, 232]  # ceil(247 * 13/16) = 201, ...
    assert projected[8] == projected[232] == 247 and projected[300] == 300
    assert _clock(600).projected_steps(10, 1.5) == 600  # a step budget ends at num_steps
    # Resumed at step 500 with a minute left at 1 s a step (the end: step 560), the
    # first paced step is past two marks: it saves there, once for both.
    late = FinalCheckpoints(_clock(10**5, 10, 9), count=4, window=0.25, every=1000, start_step=500)
    assert late.due(501, 1.0) and late.marks == [0.9375]


def test_average_takes_only_the_late_window_of_a_run_that_spans_it():
    # A slow machine's 15 minutes under the old cadence: checkpoints 200, 400, 581.
    chosen, notes = choose_steps([200, 400, 581], 4, 0.25)
    assert chosen == [581]
    assert notes[0].startswith("--num=4: the last 25% of the run's 581 steps (from step 436)")
    assert notes[1].startswith("left out steps 200, 400: before the last 25%")
    assert "--window=0.7 takes them in" in notes[1]
    # The same run with its final checkpoints: the last four, all late.
    chosen, notes = choose_steps([200, 400, 473, 509, 545, 581], 4, 0.25)
    assert chosen == [473, 509, 545, 581]
    assert notes == [notes[0]] and "left out steps 200, 400" in notes[0]


def test_average_names_the_late_checkpoints_it_did_not_need_and_window_one_is_any():
    chosen, notes = choose_steps([1200, 1268, 1365, 1400, 1463, 1560], 4, 0.25)
    assert chosen == [1365, 1400, 1463, 1560]
    assert notes == ["left out steps 1,200, 1,268: older than the last 4"]
    assert choose_steps([3, 6], 2, 1.0) == ([3, 6], [])
    assert window_start(6, 0.25) == 5 and window_start(8, 0.25) == 6  # 4.5 -> 5; 6 is in


def test_read_curve_interpolates_and_says_when_it_reads_beyond_its_ends():
    curve = ((300, 3.0), (600, 5.0), (1560, 8.0))
    assert read_curve(curve, 450) == (4.0, 0)
    assert read_curve(curve, 600) == (5.0, 0)
    assert read_curve(curve, 100) == (3.0, -1)
    assert read_curve(curve, 2000) == (8.0, 1)
    assert read_curve(((600, 5.0),), 600) == (5.0, 0)
    assert expectation(curve, 450) == "~4.0 at 450 steps (8.0 at 1,560)"
    assert expectation(curve, 1560) == "~8.0 at 1,560 steps"
    assert expectation(curve, 44) == "below 3.0 at 44 steps (3.0 at 300, its first point)"
    assert expectation(curve, 2000) == "~8.0 at 2,000 steps (measured to 1,560)"


def test_expected_bleu_parses_checks_and_round_trips():
    curve = parse_curve("600:5.1, 1560:7.9")
    assert curve == ((600, 5.1), (1560, 7.9))
    assert parse_curve(format_curve(curve)) == curve
    assert parse_curve("") == ()
    for bad in ("600:5.1,600:6", "600", "x:1", "0:1.0"):
        with pytest.raises(ConfigError, match="config.train.expected_bleu"):
            TrainConfig.from_dict({"expected_bleu": bad})
    with pytest.raises(ConfigError, match="final_window > 0"):
        TrainConfig(final_checkpoints=4, final_window=0.0)


def test_the_outlook_says_where_the_budget_ends_and_what_the_record_gives_there(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(loop.time, "perf_counter", lambda: now[0])
    pace = Pace(_clock(2000, max_minutes=10))
    assert pace.seconds(1) is None and pace.projected(1) is None  # nothing timed yet
    pace.started(1)
    now[0] += 20 * 1.5  # steps 2-21 at 1.5 s: 9.5 minutes left are 380 more steps
    assert pace.projected(21) == 401
    assert pace.outlook(21, ((300, 3.0), (600, 5.0), (1560, 8.0))) == (
        "outlook: 1.50 s a step here, so train.max_minutes=10 ends near step 401 of 2,000; "
        "by its record (train.expected_bleu) this recipe gives test BLEU ~3.7 at 401 steps "
        "(8.0 at 1,560)"
    )
    assert pace.outlook(21, ()).endswith("ends near step 401 of 2,000")
