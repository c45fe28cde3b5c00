"""Which prompt an admitted group starts from: one whose generation was lost with an earlier process
first, then the next row of the task; a row that cannot be served is skipped, not the run. And when a
prompt's images may go: once no batch on disk, no group and no held-out item shows them."""
from __future__ import annotations

from asyncrl.rewards.tasks import BadTaskRow, servable_prompt
from asyncrl.vision.images import prune_unused


def next_prompt(orch) -> tuple[int, dict, list[int]] | None:
    """(index, task row, prompt ids) of the next prompt to start; None for a row that cannot be served
    (dropped on the ledger, reported once, counted by the breaker)."""
    reissued = bool(orch.reissue)
    if reissued:
        index = orch.reissue.pop(0)
        orch.events.write("prompt_reissued", prompt_id=index)
    else:
        index = orch.cursor
        orch.cursor += 1
    try:
        entry, prompt = servable_prompt(orch.tasks, index, orch.tokenizer,
                                        orch.cfg.inference.max_prompt_tokens, orch.images)
    except BadTaskRow as e:
        if reissued:  # (a re-issued prompt was good before; it held a slot)
            orch.gate.release()
        orch.ledger.drop_prompt(index, "bad_row")
        if str(e) not in orch.bad_rows:  # (a file read in epochs meets its bad rows again)
            orch.bad_rows.add(str(e))
            orch.events.write("prompt_dropped", reason="bad_row", prompt_id=index, error=str(e))
        orch.breaker.record(0, [("bad_row", str(e))])
        return None
    if not reissued:
        orch.gate.admit()
    return index, entry, prompt


def prune_images(orch) -> int:
    """Remove the run's stored images that nothing will show again (a re-issued prompt stores its own
    again); how many went."""
    shown = {h for hs in orch.showing.values() for h in hs}
    shown |= {h for _, _, group in orch.ready for t in group for h in t.images or ()}
    shown |= orch.evaluator.images_shown() if orch.evaluator else set()
    return prune_unused(orch.images.store, shown)
