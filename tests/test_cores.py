"""The cores a process can get (asyncrl/cores.py): affinity, a cgroup's quota, other busy processes."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from asyncrl import cores


def test_a_cgroup_quota_caps_the_cores(tmp_path, monkeypatch):
    monkeypatch.setattr(cores, "CGROUP", tmp_path)
    affinity = len(os.sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cores.cgroup_quota() is None and cores.usable_cores() == affinity
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a core: one thread
    assert cores.cgroup_quota() == 0.5 and cores.usable_cores() == 1
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("150000")  # cgroup v1, 1.5 cores: two threads at most
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000")
    assert cores.usable_cores() == min(2, affinity)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to tell one busy")
def test_a_busy_process_beside_it_takes_a_core_away():
    meter = cores.CoreMeter()
    time.sleep(0.5)
    quiet = meter.free()
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1.0)
        meter.free()  # (the window that saw it start)
        time.sleep(1.0)
        busy = meter.free()
    finally:
        spinner.kill()
    assert busy <= quiet - 1 or quiet == 1, (quiet, busy)
