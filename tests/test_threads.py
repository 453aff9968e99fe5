"""The kernels' thread policy: free cores from /proc/stat readings, forced counts, the spin."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cellswarm import kernels

# two readings of /proc/stat, 1 s apart at 100 ticks/s: cpu0 idle, cpu1 busy (user), cpu2
# idle but stolen by the hypervisor, cpu3 waiting on disk (idle for us)
BEFORE = """cpu  1000 0 500 9000 10 0 0 0 0 0
cpu0 250 0 125 2250 0 0 0 0 0 0
cpu1 250 0 125 2250 0 0 0 0 0 0
cpu2 250 0 125 2250 0 0 0 0 0 0
cpu3 250 0 125 2250 10 0 0 0 0 0
intr 12345 0 0
ctxt 999
"""
AFTER = """cpu  1100 0 500 9200 110 0 0 100 0 0
cpu0 250 0 125 2350 0 0 0 0 0 0
cpu1 350 0 125 2250 0 0 0 0 0 0
cpu2 250 0 125 2250 0 0 0 100 0 0
cpu3 250 0 125 2250 110 0 0 0 0 0
intr 12399 0 0
ctxt 1999
"""


def test_cpu_times_reads_the_per_cpu_lines() -> None:
    times = kernels.cpu_times(BEFORE)
    assert sorted(times) == [0, 1, 2, 3]  # not the "cpu" total, not intr/ctxt
    assert times[0] == (375, 2625) and times[3] == (375, 2635)  # iowait is not busy


def test_a_core_busy_with_another_process_is_not_free() -> None:
    assert kernels.free_cores(BEFORE, AFTER, [0, 1]) == pytest.approx(1.0)  # cpu1 is taken
    assert kernels.threads_for(kernels.free_cores(BEFORE, AFTER, [0, 1]), 2) == 1
    assert kernels.free_cores(BEFORE, AFTER, [0, 3]) == pytest.approx(2.0)  # iowait: free
    assert kernels.free_cores(BEFORE, AFTER, [0, 2]) == pytest.approx(1.0)  # steal: taken
    assert kernels.free_cores(BEFORE, AFTER, [0, 1, 2, 3]) == pytest.approx(2.0)


def test_this_process_s_own_use_is_not_competition() -> None:
    """Our own threads busy on cpu1 (1 core of use): that core is ours to use, so free."""
    assert kernels.free_cores(BEFORE, AFTER, [0, 1], own_cores=1.0) == pytest.approx(2.0)
    assert kernels.free_cores(BEFORE, AFTER, [0, 1], own_cores=5.0) == pytest.approx(2.0)


def test_cpus_outside_the_affinity_or_unreadable_readings() -> None:
    assert kernels.free_cores(BEFORE, AFTER, [0]) == pytest.approx(1.0)
    assert kernels.free_cores(BEFORE, AFTER, [7, 8]) == 2.0  # not in /proc/stat: assume free
    assert kernels.free_cores(BEFORE, BEFORE, [0, 1]) == 2.0  # no ticks passed


def test_threads_for_counts_a_core_60_percent_free() -> None:
    assert [kernels.threads_for(f, 4) for f in (0.0, 0.5, 1.59, 1.6, 3.9, 9.0)] == [
        1, 1, 1, 2, 4, 4,
    ]  # fmt: skip


def test_set_threads_forces_a_count_and_none_samples_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = kernels.threads()
    samples = iter([1, 2])
    monkeypatch.setattr(kernels, "default_threads", lambda: next(samples))
    try:
        assert kernels.set_threads(2) == 2 and kernels.threads() == 2  # forced, even on 1 free
        assert kernels.set_threads(None) == 1 and kernels.threads() == 1  # sampled: 1 free
        assert kernels.threads() == 1  # kept, not sampled on every call
        assert kernels.set_threads(None) == 2  # sampled anew
    finally:
        monkeypatch.undo()
        kernels.set_threads(before)


def test_default_threads_is_within_the_affinity() -> None:
    n = kernels.default_threads(sample_s=0.01)
    assert 1 <= n <= len(os.sched_getaffinity(0))


SHOW_SPIN = (
    "import os; from cellswarm import kernels; kernels.enabled(); "
    "print(os.environ.get('GOMP_SPINCOUNT'))"
)


@pytest.mark.skipif(kernels.backend() != "c", reason="no C compiler on this machine")
@pytest.mark.parametrize(
    ("env", "spin"),
    [({}, kernels.SPIN_COUNT), ({"GOMP_SPINCOUNT": "5"}, "5"),
     ({"OMP_WAIT_POLICY": "active"}, "None")],
)  # fmt: skip
def test_the_spin_count_is_set_before_the_kernels_load_unless_the_user_set_one(
    env: dict[str, str], spin: str
) -> None:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run(
        [sys.executable, "-c", SHOW_SPIN], env={**clean, **env}, capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    assert out.stdout.strip() == spin
