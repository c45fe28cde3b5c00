"""The run's own collapse check (asyncrl/orchestrator/collapse.py): said once, only past its bounds, on the
numbers the real-model run showed (entropy 0.59 -> 0.15, held-out 25% -> 4.7% of 64 items)."""
from __future__ import annotations

from asyncrl.orchestrator.collapse import CollapseWatch


def test_entropy_falling_past_its_bound_is_said_once_with_what_to_lower():
    watch = CollapseWatch()
    entropies = [0.6, 0.58, 0.59, 0.4, 0.25]
    said = [watch.step({"step": i, "entropy": e}, lr=1e-4) for i, e in enumerate(entropies)]
    assert said == [None] * 5  # (0.25 is 42% of the start: above the bound)
    record = {"step": 5, "entropy": 0.15}
    warning = watch.step(record, lr=1e-4)
    assert warning["kind"] == "entropy" and "25% of its start" in warning["what"]
    assert "lower trainer.lr (now 0.0001" in warning["advice"] and record["entropy_vs_start"] < 0.35
    assert watch.step({"step": 6, "entropy": 0.1}, lr=1e-4) is None  # (said once)
    assert watch.step({"step": 7, "entropy": float("nan")}, lr=1e-4) is None


def test_held_out_accuracy_is_flagged_only_when_its_fall_is_past_the_noise():
    watch = CollapseWatch()
    evals = [(0, 0.094), (10, 0.25), (20, 0.22)]
    assert [watch.evaluation({"eval_version": v, "eval_accuracy": a, "eval_items": 64}, 1e-4)
            for v, a in evals] == [None] * 3  # (3 points below the best of 64 items: noise)
    record = {"eval_version": 30, "eval_accuracy": 0.047, "eval_items": 64}
    warning = watch.evaluation(record, 1e-4)
    assert warning["kind"] == "accuracy" and "best (25.0% at v10)" in warning["what"]
    assert abs(record["eval_below_best"] - 0.203) < 1e-9
    assert watch.evaluation({"eval_version": 40, "eval_accuracy": 0.0, "eval_items": 64}, 1e-4) is None
