"""Which prompt an admitted group starts from: one whose generation was lost with an earlier process
first, then the next row of the task; a row that cannot be served is skipped, not the run."""
from __future__ import annotations

from asyncrl.rewards.tasks import BadTaskRow, servable_prompt


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
                                        orch.cfg.inference.max_prompt_tokens)
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
