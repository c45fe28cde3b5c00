"""The console while a run goes: a live progress bar from metrics.jsonl (rich, on a terminal; a plain
line per ~5% of the run in a log), and a line for each kind of drop or fallback in events.jsonl as it
happens (the first at once, then its count every EVENT_EVERY s)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from asyncrl.rundir import RunDir

# event names that tell the user something went wrong or around: drops, failures, recoveries
NOTABLE = ("dropped", "failed", "error", "corrupt", "unreachable", "recovered", "restarted", "reissued",
           "replayed", "warning")
SAID_BY_THE_ERROR = ("role_failed", "run_stopped")  # the run's final error says these in full
EVENT_EVERY = 10.0


class Tail:
    """The complete new lines of a file another process appends to, parsed; a torn or foreign line is
    skipped, not fatal (the console must never take the run down)."""

    def __init__(self, path: Path, from_end: bool):
        self.path = path
        self.offset = path.stat().st_size if from_end and path.exists() else 0

    def records(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        out = []
        for line in complete.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                out.append(record)
        return out


class Progress:
    def __init__(self, run_dir: Path, steps: int, out=None):
        self.steps, self.out = steps, out or sys.stdout
        # a resumed run's earlier steps and events were shown by the launch that ran them
        self.metrics = Tail(RunDir(run_dir).metrics, from_end=True)
        self.events = Tail(RunDir(run_dir).events, from_end=True)
        self.step, self.eval = None, None
        self.counts: dict[tuple[str, str], int] = {}
        self.example: dict[tuple[str, str], str] = {}
        self.shown: dict[tuple[str, str], tuple[int, float]] = {}  # kind -> (count shown, when)
        self.tty = self.out.isatty()
        self.bar = _bar(self.out) if self.tty else None
        self.task = self.bar.add_task("run", total=steps, line="starting") if self.bar else None

    def close(self) -> None:
        if self.bar:
            self.bar.stop()

    def poll(self, final: bool = False) -> None:
        """Show what is new (the last step always); `final`: every count that changed since it was last
        shown, however recently."""
        self._poll_events(final)
        changed = False
        for record in self.metrics.records():
            if "eval_accuracy" in record:
                self.eval = record
            elif "step" in record:
                self.step = record
            changed = True
        # On a terminal the line is rewritten in place; in a log, one line per ~5% of the run.
        steps = self.step.get("steps", self.steps) if self.step else self.steps  # (live: asyncrl ctl)
        every = 1 if self.tty else max(1, steps // 20)
        last = self.step is not None and self.step["step"] + 1 == steps
        if changed and self.step and ((self.step["step"] + 1) % every == 0 or last):
            self.show()

    def _poll_events(self, final: bool) -> None:
        for record in self.events.records():
            event = str(record.get("event", ""))
            if event == "repeated":  # the writer counts from here on: take its count
                kind = (str(record.get("of")), str(record.get("reason", "")))
                self.counts[kind] = max(self.counts.get(kind, 0), int(record.get("count", 0)))
                continue
            if event in SAID_BY_THE_ERROR or not any(word in event for word in NOTABLE):
                continue
            kind = (event, str(record.get("reason", "")))
            self.counts[kind] = self.counts.get(kind, 0) + 1
            self.example.setdefault(kind, str(next((record[k] for k in ("error", "why", "detail", "what")
                                                    if record.get(k)), "")))
        now = time.monotonic()
        for kind, count in self.counts.items():
            shown, when = self.shown.get(kind, (0, -EVENT_EVERY))
            if count > shown and (final or now - when >= EVENT_EVERY):
                self.shown[kind] = (count, now)
                self._say(self._event_line(kind, count))

    def _event_line(self, kind: tuple[str, str], count: int) -> str:
        event, reason = kind
        example = self.example.get(kind, "")
        # (a warning's example is its advice, said in full)
        example = example if event.endswith("warning") else example[:160]
        return (f"! {event}{f' ({reason})' if reason else ''}: {count} so far"
                + (f" — e.g. {example}" if example else "") + " (events.jsonl)")

    def _say(self, line: str) -> None:
        """A line of its own (above the bar, on a terminal)."""
        if self.bar:
            self.bar.console.print(line, markup=False, highlight=False)
        else:
            print(line, file=self.out, flush=True)

    def show(self) -> None:
        s = self.step
        ev = f" | eval {self.eval['eval_accuracy']:.1%}@v{self.eval['eval_version']}" if self.eval else ""
        steps = s.get("steps", self.steps)  # (run.steps is live)
        numbers = (
            f"reward {s.get('reward', 0):.3f} | acc {s.get('accuracy', 0):.1%}{ev}"
            f" | stale {s.get('staleness_mean', 0):.2f} (max {s.get('staleness_max', 0)})"
            f" | gen {s.get('gen_tokens_per_s', 0):.0f} tok/s"
            f" | train {s.get('train_tokens_per_s', 0):.0f} tok/s"
        )
        if self.bar:
            self.bar.update(self.task, completed=s["step"] + 1, total=steps, line=numbers)
        else:
            line = f"step {s['step'] + 1}/{steps} | {numbers} | {s.get('time', 0):.0f}s"
            print(line, file=self.out, flush=True)


def _bar(out):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(bar_width=24), TimeElapsedColumn(),
                   TextColumn("{task.fields[line]}"), console=Console(file=out), refresh_per_second=4)
    bar.start()
    return bar
