"""The test-only seam a stage's planted faults live behind (ring/faults.py): a stage built
without test flags asks NO_FAULTS, whose answers are all "nothing"; each planted fault acts
where it is asked, and nowhere else."""

from __future__ import annotations

import pytest

from cellswarm.swarm.ring.faults import NO_FAULTS, Faults


def test_no_faults_changes_nothing() -> None:
    for steps in (0, 10**6):
        NO_FAULTS.before_step(steps, [1, 2, 3])
    NO_FAULTS.stall()
    assert [NO_FAULTS.token(s, 7, True, 100) for s in range(50)] == [7] * 50
    assert NO_FAULTS.corrupted == set()


def test_each_planted_fault_acts_where_it_is_asked() -> None:
    with pytest.raises(RuntimeError, match="forward pass always fails"):
        Faults(fail_forward=True).before_step(0)
    poison = Faults(fail_token=5)
    poison.before_step(0, [1, 2, 3])  # another prompt: nothing
    poison.before_step(0)  # a later step (no prompt): nothing
    with pytest.raises(RuntimeError, match="first step always fails"):
        poison.before_step(0, [4, 5, 6])
    bad = Faults(perturb=1.0)
    assert bad.token(1, 7, False, 100) == 7  # only a sequence's first step picks it
    first = bad.token(1, 7, True, 100)
    assert first != 7 and bad.corrupted == {1} and bad.token(1, 7, False, 100) != 7
    bad.forget(1)
    assert bad.token(1, 7, False, 100) == 7
    stalled = Faults(stall_once_s=0.01)
    stalled.stall()
    assert stalled.stall_once_s == 0.0  # once
