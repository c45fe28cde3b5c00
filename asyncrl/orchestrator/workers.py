"""The orchestrator's side of joined workers (asyncrl/swarm/): their gateway opened and closed with the
run, a quarantined worker's groups dropped from the ready pool, and the samples the trainer masked
(asyncrl/swarm/quarantine.py) recorded in the ledger."""
from __future__ import annotations

import heapq

from asyncrl.orchestrator import staleness
from asyncrl.swarm import gateway
from asyncrl.swarm.members import Swarm


def swarm(orch) -> Swarm:
    joined = Swarm(orch.cfg, orch.run_dir, orch.router, orch.ledger, orch.events, orch.tokenizer)
    joined.on_quarantine = lambda name: drop_ready(orch, name)
    joined.drop = lambda group: drop(orch, group)
    joined.offer = lambda group: offer(orch, group)
    return joined


async def offer(orch, group) -> None:
    """A held group whose checks passed: into the ready pool, and the batch assembly told."""
    staleness.offer(orch.ready, min(t.oldest_version for t in group), group[0].prompt_id, group)
    await orch._notify()


async def open_gateway(orch):
    if orch.swarm is None:
        return None
    # a restarted orchestrator takes the port its workers know, when it is free
    runner, url = await gateway.serve(orch.swarm, orch.run_dir, orch.ledger.get("gateway_port"))
    orch.ledger.put("gateway_port", int(url.rsplit(":", 1)[1]))
    orch.events.write("gateway_started", url=url)
    return runner


async def close_gateway(orch, runner) -> None:
    if runner is not None:
        await orch.swarm.close()
        await gateway.close(runner, orch.run_dir)


def drop(orch, group, why: str = "quarantined") -> None:
    orch.gate.release()
    orch.ledger.drop_group(group, why)
    orch.events.write("group_dropped", reason=why, prompt_id=group[0].prompt_id,
                      worker=group[0].info.get("worker"))


def drop_ready(orch, name: str) -> None:
    """Every group in the ready pool the quarantined worker generated and a recompute did not verify."""
    kept = []
    for entry in orch.ready:
        group = entry[2]
        if group[0].info.get("worker") == name and orch.swarm.refuses(group):
            drop(orch, group)
        else:
            kept.append(entry)
    if len(kept) != len(orch.ready):
        orch.ready[:] = kept
        heapq.heapify(orch.ready)


def record_masked(orch, version: int, marker: dict) -> None:
    """The trainer masked these samples of quarantined workers in the batch of `version`."""
    masked = marker.get("quarantined_samples") or []
    if masked:
        orch.ledger.note(masked, "quarantined_masked")
        orch.events.write("samples_masked", step=version - 1, samples=len(masked),
                          reason="quarantined worker")
