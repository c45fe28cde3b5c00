"""A run that is collapsing says so while it runs: entropy falling far below its start (the policy sharpening
onto a few answers), or held-out accuracy falling well below its best (what it learnt, unlearnt).

Seen on SmolLM2-135M at the toy's lr (1e-4): held-out 9% -> 25% (v10) -> 5% (v20), sampled reward 0.53 ->
0.0, entropy 0.59 -> 0.15. Each check needs a baseline first (the mean of the first ENTROPY_BASELINE steps'
entropy; the best evaluation so far), so a run that starts sharp is not flagged for being sharp.
"""
from __future__ import annotations

import math

ENTROPY_BASELINE = 3  # steps whose mean entropy is the run's start
ENTROPY_FLOOR = 0.35  # flagged below this share of the start
# flagged when accuracy falls this far below its best: 2 standard errors of the difference of two
# evaluations at that accuracy, and never less than ACCURACY_MIN_DROP
ACCURACY_MIN_DROP = 0.05


class CollapseWatch:
    """Adds `entropy_vs_start` to step records and `eval_below_best` to evaluation records (the metrics), and
    returns a warning's fields the first time either crosses its bound (the console line)."""

    def __init__(self):
        self.entropies: list[float] = []
        self.best: tuple[float, int] | None = None  # (accuracy, version)
        self.said: set[str] = set()

    def step(self, record: dict, lr: float) -> dict | None:
        """A warning (an event's fields) when this step's entropy shows collapse, said once per run."""
        entropy = record.get("entropy")
        if not isinstance(entropy, (int, float)) or not math.isfinite(entropy):
            return None
        if len(self.entropies) < ENTROPY_BASELINE:
            self.entropies.append(entropy)
            return None
        start = sum(self.entropies) / len(self.entropies)
        record["entropy_vs_start"] = entropy / start if start > 0 else math.nan
        if entropy >= ENTROPY_FLOOR * start or "entropy" in self.said:
            return None
        self.said.add("entropy")
        return _warning(lr, "entropy", f"entropy {entropy:.3f} at step {record.get('step')} is "
                                        f"{entropy / start:.0%} of its start ({start:.3f})")

    def evaluation(self, record: dict, lr: float) -> dict | None:
        """A warning when held-out accuracy has fallen well below its best, said once per run."""
        accuracy, version, items = record["eval_accuracy"], record["eval_version"], record["eval_items"]
        if self.best is None or accuracy > self.best[0]:
            self.best = (accuracy, version)
        best, at = self.best
        record["eval_below_best"] = best - accuracy
        spread = math.sqrt(max(best * (1 - best), accuracy * (1 - accuracy)) * 2 / max(items, 1))
        if best - accuracy <= max(2 * spread, ACCURACY_MIN_DROP) or "accuracy" in self.said:
            return None
        self.said.add("accuracy")
        return _warning(lr, "accuracy", f"held-out accuracy {accuracy:.1%} at v{version} is "
                                         f"{best - accuracy:.1%} below its best ({best:.1%} at v{at})")



def _warning(lr: float, kind: str, what: str) -> dict:
    advice = (f"lower trainer.lr (now {lr:g}; `asyncrl ctl RUN set trainer.lr {lr / 4:g}` works live), or "
              "raise objective.kl_coef / objective.entropy_coef")
    return {"kind": kind, "what": what, "advice": advice, "detail": f"{what}: {advice}"}
