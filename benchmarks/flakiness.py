"""How far each learning, timing and recovery test passes by: run them many times, two test runs at
once (each the other's load, as CI's machine may have), and report the spread of what each test
measures against the bound it asserts.

    python benchmarks/flakiness.py --runs 10 [TEST ...]

Tests report their measured quantities through the `record` fixture (tests/conftest.py). A test's
margin is (mean − bound) / standard deviation over the runs; the project's rule is at least 5.
Writes benchmarks/results/flakiness.{json,md}. Builds the tiny policies once and hands them to
every run (ASYNCRL_TEST_MODEL, ASYNCRL_TEST_CALC_MODEL).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
# the tests whose outcome depends on learning, timing, a race or a random seed
DEFAULT_TESTS = [
    "tests/test_e2e.py",
    "tests/test_recovery.py",
    "tests/test_agents.py",
    "tests/test_tokens.py",
    "tests/test_server.py",
    "tests/test_bad_input.py",
]


def build_models(workdir: Path) -> dict[str, str]:
    """The session fixtures' policies, built once in a process of their own."""
    code = (
        "import sys; sys.path.insert(0, 'tests'); import conftest; from asyncrl.config import load_config; "
        "from asyncrl.policy.warmstart import warmstart; "
        f"warmstart(load_config(), '{workdir}/tiny', log=lambda *a, **k: None); "
        "cfg = load_config(overrides={'warmstart': {'demos': 'examples/agents/calculator.py:demos', "
        "'steps': 300, "
        "'batch_size': 32, 'hidden_size': 64, 'layers': 2, 'lr': 3e-3, **conftest.CHAR_POLICY}}); "
        f"warmstart(cfg, '{workdir}/calc', log=lambda *a, **k: None)"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    return {"ASYNCRL_TEST_MODEL": f"{workdir}/tiny", "ASYNCRL_TEST_CALC_MODEL": f"{workdir}/calc"}


def run_pair(tests: list[str], env: dict, records: Path, index: int) -> list[dict]:
    """Two pytest runs of `tests` at once; each one's outcome per test."""
    procs = []
    for k in range(2):
        report = records.parent / f"junit-{index}-{k}.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *tests]
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env={**env, "ASYNCRL_TEST_RECORD": str(records)},
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), report))
    outcomes = []
    for proc, report in procs:
        out, _ = proc.communicate()
        outcomes.append({"returncode": proc.returncode, "failures": _failures(report), "tail": out[-1500:]})
    return outcomes


def _failures(report: Path) -> list[str]:
    import xml.etree.ElementTree as ET

    if not report.exists():
        return ["(no report)"]
    return [f"{case.get('classname')}::{case.get('name')}" for case in ET.parse(report).iter("testcase")
            if case.find("failure") is not None or case.find("error") is not None]


def spread(records: list[dict]) -> list[dict]:
    """Per (test, quantity): runs, mean, std, min, bound, margin in standard deviations."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        groups.setdefault((r["test"], r["name"]), []).append(r)
    rows = []
    for (test, name), rs in sorted(groups.items()):
        values = [r["value"] for r in rs]
        bound = rs[0]["threshold"]
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        mean = statistics.fmean(values)
        margin = (mean - bound) / std if std > 0 else float("inf")
        rows.append(
            {
                "test": test,
                "quantity": name,
                "runs": len(values),
                "mean": round(mean, 4),
                "std": round(std, 4),
                "min": min(values),
                "max": max(values),
                "bound": bound,
                "margin_sd": round(margin, 1),
            }
        )
    return rows


def table(rows: list[dict], failures: dict[str, int], runs: int) -> str:
    lines = [
        "| test | quantity | runs | mean | std | min | bound | margin (σ) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['test'].split('/')[-1]} | {r['quantity']} | {r['runs']} | {r['mean']} | {r['std']} | "
            f"{r['min']} | > {r['bound']} | {r['margin_sd']} |"
        )
    lines.append(
        f"\nfailures over {runs} runs: " + (", ".join(f"{t} ×{n}" for t, n in failures.items()) or "none")
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("tests", nargs="*", default=DEFAULT_TESTS)
    parser.add_argument("--runs", type=int, default=10, help="test runs in all (two at a time)")
    parser.add_argument("--out", default=str(RESULTS / "flakiness"))
    parser.add_argument("--models", help="a folder with tiny/ and calc/ from an earlier run (skips building)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="asyncrl-flaky-"))
    models = (
        {"ASYNCRL_TEST_MODEL": f"{args.models}/tiny", "ASYNCRL_TEST_CALC_MODEL": f"{args.models}/calc"}
        if args.models
        else build_models(workdir)
    )
    env = {**os.environ, **models}
    records_path = workdir / "records.jsonl"
    failures: dict[str, int] = {}
    start = time.monotonic()
    for pair in range((args.runs + 1) // 2):
        for outcome in run_pair(args.tests, env, records_path, pair):
            for test in outcome["failures"]:
                failures[test] = failures.get(test, 0) + 1
            if outcome["returncode"] not in (0, 1):
                print(outcome["tail"], file=sys.stderr)
        print(f"pair {pair + 1}: {time.monotonic() - start:.0f} s, failures so far {failures}", flush=True)
    records = (
        [json.loads(line) for line in records_path.read_text().splitlines()] if records_path.exists() else []
    )
    rows = spread(records)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(
        json.dumps(
            {
                "runs": args.runs,
                "tests": args.tests,
                "failures": failures,
                "spread": rows,
                "records": records,
            },
            indent=1,
        )
    )
    out.with_suffix(".md").write_text(table(rows, failures, args.runs) + "\n")
    print(table(rows, failures, args.runs))


if __name__ == "__main__":
    main()
