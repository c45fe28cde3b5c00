"""The console's live line: new records of metrics.jsonl as they arrive."""
from __future__ import annotations

import json
import sys
from pathlib import Path


class Progress:
    """Reads new lines of metrics.jsonl and keeps one live line on the console."""

    def __init__(self, run_dir: Path, steps: int, out=sys.stdout):
        self.path, self.steps, self.out = run_dir / "metrics.jsonl", steps, out
        # a resumed run's earlier steps were shown by the launch that ran them
        self.offset = self.path.stat().st_size if self.path.exists() else 0
        self.step, self.eval = None, None
        self.tty = out.isatty()

    def poll(self) -> None:
        if not self.path.exists():
            return
        with open(self.path) as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        self.offset += len(complete)
        changed = False
        for line in complete.splitlines():
            record = json.loads(line)
            if "eval_accuracy" in record:
                self.eval = record
            else:
                self.step = record
            changed = True
        # On a terminal the line is rewritten in place; in a log, one line per ~5% of the run.
        every = 1 if self.tty else max(1, self.steps // 20)
        if changed and self.step and (self.step["step"] + 1) % every == 0:
            self.show()

    def show(self) -> None:
        s = self.step
        ev = f" | eval {self.eval['eval_accuracy']:.1%}@v{self.eval['eval_version']}" if self.eval else ""
        line = (
            f"step {s['step'] + 1}/{self.steps} | reward {s.get('reward', 0):.3f} "
            f"| acc {s.get('accuracy', 0):.1%}{ev}"
            f" | stale {s.get('staleness_mean', 0):.2f} (max {s.get('staleness_max', 0)})"
            f" | gen {s['gen_tokens_per_s']:.0f} tok/s | train {s.get('train_tokens_per_s', 0):.0f} tok/s"
            f" | {s['time']:.0f}s"
        )
        print(
            ("\r" + line.ljust(120)) if self.tty else line,
            end="" if self.tty else "\n",
            file=self.out,
            flush=True,
        )
