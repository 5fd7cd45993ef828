"""A short chaos run in the suite (tests/chaos.py runs long ones on demand)."""

import chaos


def test_random_kills_leave_the_result_of_an_undisturbed_run(capsys):
    assert chaos.run(kills=2, workers=2, steps=25, seed=7, step_time=0.1)
    assert "orphans 0" in capsys.readouterr().out
