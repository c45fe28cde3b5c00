import random
import statistics

import pytest

from asyncrl.orchestrator.advantages import group_advantages
from asyncrl.orchestrator.staleness import StalenessGate


def admit_all(gate, version):
    n = 0
    while gate.can_admit(version):
        gate.admit()
        n += 1
    return n


def test_eta_zero_is_synchronous():
    gate = StalenessGate(groups_per_step=3, max_staleness=0)
    assert admit_all(gate, version=0) == 3  # batch 0 only
    assert not gate.can_admit(0)
    assert admit_all(gate, version=1) == 3  # batch 1 starts only once version 1 is served


def test_eta_k_admits_k_batches_ahead():
    gate = StalenessGate(groups_per_step=2, max_staleness=4)
    assert admit_all(gate, version=0) == 2 * 5
    assert admit_all(gate, version=1) == 2


def test_release_gives_capacity_back():
    gate = StalenessGate(groups_per_step=2, max_staleness=1)
    admit_all(gate, 0)
    gate.release()
    assert gate.can_admit(0)


def test_fresh_enough():
    gate = StalenessGate(groups_per_step=2, max_staleness=1)
    assert gate.fresh_enough(oldest_version=4, step=5)
    assert not gate.fresh_enough(oldest_version=3, step=5)


def test_group_advantages():
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    adv = group_advantages([1.0, 0.0])
    assert abs(adv[0] - 1.0) < 1e-5 and abs(adv[1] + 1.0) < 1e-5  # population std = 0.5
    assert group_advantages([1.0, 0.0, 0.0, 1.0], "dr_grpo") == [0.5, -0.5, -0.5, 0.5]
    assert group_advantages([3.0, 0.0, 0.0], "rloo") == [3.0, -1.5, -1.5]
    rewards = [random.Random(seed).uniform(-5, 5) for seed in range(16)]  # population std, to float precision
    mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
    assert group_advantages(rewards) == pytest.approx([(r - mean) / (std + 1e-6) for r in rewards], rel=1e-12)


def test_a_wave_is_cut_into_contiguous_parts_per_replica_and_engine_batch():
    from asyncrl.orchestrator.waves import parts

    wave = list(range(10))
    for replicas, most in [(1, 32), (3, 32), (1, 4), (2, 3), (20, 32), (0, 32), (1, 0)]:
        cut = parts(wave, replicas, most)
        assert [i for part in cut for i in part] == wave and all(cut)
        assert len(cut) >= min(replicas, len(wave)) and all(len(p) <= max(most, 1) for p in cut)
        assert max(map(len, cut)) - min(map(len, cut)) <= 1  # even
    assert parts([], 2, 32) == []
