"""A benchmark's rows, written as benchmarks/results/<name>.json and as a Markdown table <name>.md."""
from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).parent / "results"


def write_rows(name: str, rows: list[dict]) -> str:
    """Write both files; returns the table (also printed)."""
    OUT.mkdir(exist_ok=True)
    (OUT / f"{name}.json").write_text(json.dumps(rows, indent=1))
    keys = list(rows[0])
    md = "\n".join(["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
                   + ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows])
    (OUT / f"{name}.md").write_text(md + "\n")
    print(md)
    return md
