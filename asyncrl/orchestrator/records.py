"""What the orchestrator records about a step: the batch's statistics (into the ledger) and where
each role's time went (into the step's metrics record)."""
from __future__ import annotations

import time

from asyncrl.observe.profile import Phases
from asyncrl.trajectory import Trajectory


def batch_stats(step: int, trajs: list[Trajectory], dropped: int) -> dict:
    rewards = [t.reward for t in trajs]
    stale = [t.staleness(step) for t in trajs]
    return {
        "reward": sum(rewards) / len(rewards),
        "accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
        "samples": len(trajs),
        "staleness_hist": {str(s): stale.count(s) for s in sorted(set(stale))},
        "dropped_stale_groups": dropped,
        "completion_tokens": sum(sum(t.loss_mask) for t in trajs),
        **task_stats(trajs),
    }


def task_stats(trajs: list[Trajectory]) -> dict:
    """reward/<task>, accuracy/<task>, samples/<task> when the batch mixes tasks; turns and tool
    use when agents played it."""
    out = {}
    tasks = sorted({t.task for t in trajs})
    for task in tasks if len(tasks) > 1 else []:
        rewards = [t.reward for t in trajs if t.task == task]
        out.update({f"reward/{task}": sum(rewards) / len(rewards), f"samples/{task}": len(rewards),
                    f"accuracy/{task}": sum(r >= 1.0 for r in rewards) / len(rewards)})
    scored = [t.info for t in trajs if "score_seconds" in t.info]
    if scored:  # on-policy distillation: the teacher's time on a sample, and its share of the sample's wait
        out.update({"teacher_seconds_mean": sum(i["score_seconds"] for i in scored) / len(scored),
                    "teacher_share": sum(i["score_seconds"] / max(i["score_seconds"] + i["generate_seconds"],
                                                                 1e-9) for i in scored) / len(scored)})
    played = [t.info for t in trajs if "turns" in t.info]
    if played:
        out.update({"turns_mean": sum(i["turns"] for i in played) / len(played),
                    "tool_calls_mean": sum(i["tool_calls"] for i in played) / len(played),
                    "tool_errors": sum(i["tool_errors"] for i in played),
                    "truncated_fraction": sum(bool(i["truncated"]) for i in played) / len(played)})
    return out


def profile(stats: dict, phases: Phases, verifiers, cpu_at_start: float, up_since: float) -> dict:
    """Running totals of where each role's time went (asyncrl/observe/profile.py), for the report's chart:
    the inference server's phases from its /stats, the orchestrator's own, the verifiers' CPU."""
    inference = {f"time/inference/{k}": round(v, 4) for k, v in stats.get("phases", {}).items()}
    return {
        **inference,
        **{k: v for k, v in stats.get("teacher", {}).items() if k.startswith("time/")},
        "time/inference/uptime": stats["uptime_seconds"],
        **phases.totals("time/orchestrator"),
        "time/orchestrator/cpu": time.process_time() - cpu_at_start,
        "time/orchestrator/uptime": time.monotonic() - up_since,
        "time/verifiers/score": verifiers.cpu_seconds,
    }


MARKER_IDS = ("step", "version", "hash", "serving_hash", "batch_digest")  # a marker's fields, not metrics


def step_record(orch, version: int, marker: dict, stats: dict) -> dict:
    """The metrics record of version `version`: the batch's statistics, the trainer's marker, the
    inference server's counters (`stats`) and where each role's time went. Starts the next record's
    rates and peaks."""
    now, tokens = time.monotonic(), stats["tokens_generated"]
    (t_prev, tok_prev), orch.last_gen = orch.last_gen, (now, tokens)
    # (0 across a restart, whose counter starts again)
    generated = tokens - tok_prev if tok_prev is not None and tokens >= tok_prev else 0
    peak, orch.in_flight_peak = orch.in_flight_peak, len(orch.in_flight)
    return {
        "step": version - 1, "version": version, "time": orch._now(),
        "steps": orch.cfg.run.steps,  # (the run's length: live, asyncrl ctl RUN stop / set run.steps)
        **orch.ledger.step_stats(version - 1),
        "gen_tokens_per_s": generated / max(now - t_prev, 1e-9),
        "inference_busy_seconds": stats["busy_seconds"],
        "tokens_discarded": stats.get("tokens_discarded", 0),
        # (the built-in engine's, all told: fed to admit requests, and found in its prefix cache)
        "tokens_prefilled": stats.get("tokens_prefilled", 0),
        "tokens_reused": stats.get("tokens_reused", 0),
        "inference_idle_seconds": stats["uptime_seconds"] - stats["busy_seconds"],
        "trainer_busy_seconds": marker.pop("busy_seconds"),
        "trainer_idle_seconds": marker.pop("idle_seconds"),
        "orchestrator_cpu_seconds": time.process_time(),
        "serve_seconds": orch.serve_seconds,
        **profile(stats, orch.phases, orch.verifiers, orch.cpu_at_start, orch.up_since),
        "in_flight_groups": len(orch.in_flight), "in_flight_groups_max": peak,
        "ready_groups": len(orch.ready), "replicas_routed": stats["replicas_routed"],
        # the engines' cost lines, summed over replicas (asyncrl/observe/fit.py; absent from vLLM)
        **{k: stats[k] for k in ("decode_fit", "prefill_fit") if k in stats},
        **{k: v for k, v in stats.get("teacher", {}).items() if not k.startswith("time/")},
        **{k: v for k, v in marker.items() if k not in MARKER_IDS},
    }
