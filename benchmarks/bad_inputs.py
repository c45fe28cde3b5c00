"""The bad-input battery: what a user sees for each bad input or fault, tried through the real CLI.

    python benchmarks/bad_inputs.py [--model PATH] [--only NAME ...]   (--only: re-run those rows)

Each case writes what it needs (a data file, user code, a damaged run directory), runs `asyncrl`
as a user would with a deadline, and records the exit code, the seconds, the last line of stderr
(the one sentence the user reads), the console's drop lines and the size of events.jsonl. Nothing
is asserted here (tests/test_bad_input.py and tests/test_recovery.py assert); this is the table in
docs/recovery.md, measured: benchmarks/results/bad_inputs.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DEADLINE = 300

USER_CODE = '''
import os, time

def raises(completion, entry):
    return 1 / 0

def sleeps(completion, entry):
    time.sleep(3600)

def text(completion, entry):
    return "correct"

def nan(completion, entry):
    return float("nan")

def dies(completion, entry):
    os._exit(7)

def none(completion, entry):
    return None

from asyncrl.objectives.ppo_clip import loss as _ppo

def detached(inp, cfg):
    loss, metrics = _ppo(inp, cfg)
    return loss.detach(), metrics

def scalar(inp, cfg):
    loss, metrics = _ppo(inp, cfg)
    return loss.sum(), metrics

def one_value(inp, cfg):
    return _ppo(inp, cfg)[0]

def exploding(inp, cfg):
    raise RuntimeError("objective exploded")

from asyncrl.agents import tool

@tool
def set_tool() -> str:
    "returns a set"
    return {1, 2}

async def text_agent(task, ctx):
    await ctx.complete(task["prompt"])
    return "great"

async def set_tool_agent(task, ctx):
    await ctx.complete(task["prompt"])
    await ctx.call_tool(set_tool, {})
    return 1.0

async def raising_agent(task, ctx):
    raise ValueError("agent bug")

def not_async(task, ctx):
    return 1.0
'''

SHORT = ["--run.steps", "3", "--trainer.threads", "1", "--inference.threads", "1", "--task.eval_size", "0",
         "--timeouts.startup", "60"]


def rows(path: Path, lines: list) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


TAKEN: list = []  # sockets held open while their case runs (an explicit port that is taken)


def taken_port() -> str:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    TAKEN.append(s)
    return str(s.getsockname()[1])


def sums(n: int = 40) -> list[dict]:
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10, 10 + n) for b in (11, 12)]


def cases(work: Path, model: str) -> list[dict]:
    """name, what is wrong, args (or a setup that returns them)."""
    m = ["--model.path", model, "--run.root", str(work / "runs")]

    def run(name: str, *extra: str) -> list[str]:
        return ["train", *m, "--run.name", name, *SHORT, *extra]

    def damaged_resume(name: str, damage) -> callable:
        def setup() -> list[str]:
            cmd = [sys.executable, "-m", "asyncrl.cli", *run(name, "--trainer.checkpoint_every", "2")]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=DEADLINE, env=env(work))
            if done.returncode:
                raise RuntimeError(f"the run to damage failed: {done.stderr[-500:]}")
            damage(work / "runs" / name)
            return ["train", "--resume", str(work / "runs" / name), "--run.steps", "5"]
        return setup

    def truncate_newest_weights(d: Path) -> None:
        f = sorted(p for p in (d / "weights").glob("v*.safetensors") if ".patch" not in p.name)[-1]
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])

    def empty_model() -> list[str]:
        (work / "empty").mkdir(exist_ok=True)
        return ["train", "--model.path", str(work / "empty"), "--run.root", str(work / "runs")]

    def model_copy(name: str, damage) -> callable:
        def setup() -> list[str]:
            d = work / name
            shutil.rmtree(d, ignore_errors=True)
            shutil.copytree(model, d)
            damage(d)
            return ["train", "--model.path", str(d), "--run.root", str(work / "runs"), "--run.name", name]
        return setup

    def cut(f: Path) -> None:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])

    def write(name: str, data: bytes) -> str:
        (work / name).write_bytes(data)
        return str(work / name)

    def ended_run() -> list[str]:
        done = subprocess.run([sys.executable, "-m", "asyncrl.cli", *run("ended")], capture_output=True,
                              text=True, timeout=DEADLINE, env=env(work))
        if done.returncode:
            raise RuntimeError(f"the run to end failed: {done.stderr[-500:]}")
        return ["ctl", str(work / "runs" / "ended"), "status"]

    demos = str(ROOT / "examples/agents/calculator.py") + ":demos"
    huge_row = sums()[:20] + [{"prompt": "9" * 10_000_000, "answer": "1"}] + sums()[20:]
    jsonl = ["--task.name", "jsonl"]
    agent = ["--task.name", "jsonl", "--task.path", rows(work / "sums.jsonl", sums())]
    return [
        {"name": "config typo", "args": ["train", "--rollout.max_stalenes", "1", *m]},
        {"name": "lr = inf", "args": run("inf", "--trainer.lr", "inf")},
        {"name": "lr = 1e30 (weights overflow)", "args": run("huge_lr", "--trainer.lr", "1e30",
                                                            "--trainer.warmup_steps", "0")},
        {"name": "negative group size", "args": run("neg", "--rollout.group_size", "-2")},
        {"name": "run.name '../x'", "args": run("../x")},
        {"name": "unknown dataset", "args": run("nods", "--task.name", "no_such_task")},
        {"name": "unknown objective", "args": run("noobj", "--objective.name", "nope")},
        {"name": "objective import path that does not import",
         "args": run("objimp", "--objective.import_path", "no_module:fn")},
        {"name": "verifier import path that does not import", "args": run("verimp", "--task.verifier",
                                                                        "no_module:fn")},
        {"name": "agent that is not async", "args": run("agsync", *agent, "--agent.path",
                                                        "bad_user_code:not_async")},
        {"name": "task file missing", "args": run("nofile", *jsonl, "--task.path", str(work / "none.jsonl"))},
        {"name": "task file empty",
         "args": run("emptyfile", *jsonl, "--task.path", rows(work / "e.jsonl", []))},
        {"name": "every task row invalid", "args": run("allbad", *jsonl, "--task.path",
                                                       rows(work / "bad.jsonl", ['{"q": 1}', "not json"]))},
        {"name": "model.path missing", "args": ["train", "--model.path", str(work / "nowhere"), *m[2:]]},
        {"name": "model.path an empty directory", "setup": empty_model},
        {"name": "model.safetensors truncated",
         "setup": model_copy("cut", lambda d: cut(d / "model.safetensors"))},
        {"name": "model without config.json",
         "setup": model_copy("nocfg", lambda d: (d / "config.json").unlink())},
        {"name": "model without tokenizer", "setup": model_copy("notok", lambda d: [
            (d / f).unlink() for f in ("tokenizer.json", "tokenizer_config.json") if (d / f).exists()])},
        {"name": "verifier always raises", "args": run("raises", "--task.verifier", "bad_user_code:raises",
                                                       "--rollout.max_failed_samples", "256")},
        {"name": "verifier always sleeps", "args": run("sleeps", "--task.verifier", "bad_user_code:sleeps",
                                                       "--timeouts.verifier", "2",
                                                       "--timeouts.no_accepted_sample", "30")},
        {"name": "verifier returns a string", "args": run("text", "--task.verifier", "bad_user_code:text")},
        {"name": "verifier returns None", "args": run("none", "--task.verifier", "bad_user_code:none")},
        {"name": "verifier always NaN", "args": run("nan", "--task.verifier", "bad_user_code:nan",
                                                    "--rollout.max_failed_samples", "256")},
        {"name": "verifier kills its process", "args": run("dies", "--task.verifier", "bad_user_code:dies",
                                                           "--rollout.max_failed_samples", "256")},
        {"name": "objective returns a detached loss", "args": run("detached", "--objective.import_path",
                                                                  "bad_user_code:detached")},
        {"name": "objective returns a scalar", "args": run("scalar", "--objective.import_path",
                                                           "bad_user_code:scalar")},
        {"name": "objective returns one value", "args": run("onevalue", "--objective.import_path",
                                                            "bad_user_code:one_value")},
        {"name": "objective raises", "args": run("exploding", "--objective.import_path",
                                                 "bad_user_code:exploding", "--run.max_restarts", "1")},
        {"name": "agent returns a string", "args": run("agtext", *agent, "--agent.path",
                                                       "bad_user_code:text_agent")},
        {"name": "tool returns a set", "args": run("agset", *agent, "--agent.path",
                                                   "bad_user_code:set_tool_agent")},
        {"name": "agent always raises", "args": run("agraise", *agent, "--rollout.max_failed_samples", "64",
                                                    "--agent.path", "bad_user_code:raising_agent")},
        {"name": "ray: an address nobody answers", "args": run("rayaddr", "--run.launcher", "ray",
                                                               "--run.ray_address", "127.0.0.1:1")},
        {"name": "ray: replicas that cannot be placed", "args": run(
            "rayplace", "--run.launcher", "ray", "--run.ray_address", "local", "--inference.ray_resources",
            "{no_such_node = 1}", "--run.ray_placement_timeout", "5")},
        {"name": "ray with vLLM replicas", "args": run("rayvllm", "--run.launcher", "ray",
                                                       "--inference.engine", "vllm",
                                                       "--inference.update_policy", "finish")},
        {"name": "zero replicas", "args": run("norep", "--inference.replicas", "0")},
        {"name": "resume: ledger.db deleted", "setup": damaged_resume(
            "noledger", lambda d: [f.unlink() for f in d.glob("ledger.db*")])},
        {"name": "resume: newest weights truncated",
         "setup": damaged_resume("cutweights", truncate_newest_weights)},
        {"name": "resume: config.json not JSON", "setup": damaged_resume(
            "badcfg", lambda d: (d / "config.json").write_text("{not json"))},
        {"name": "resume: a directory that is not a run", "args": ["train", "--resume", str(work)]},
        {"name": "report: not a run directory", "args": ["report", str(work / "nowhere")]},
        {"name": "report: a hand-edited metrics record", "setup": lambda: [
            (work / "edited").mkdir(exist_ok=True), rows(work / "edited" / "metrics.jsonl", [{"step": "x"}]),
            ["report", str(work / "edited")]][-1]},
        {"name": "rollout.max_tokens 1e9 (past the model's context)",
         "args": run("maxtok", "--rollout.max_tokens", "1000000000")},
        {"name": "prompt + answer past the model's context",
         "args": run("ctx", "--inference.max_prompt_tokens", "600")},
        {"name": "rollout.group_size 1e6 (past the server's queue)",
         "args": run("bigG", "--rollout.group_size", "1000000")},
        {"name": "a minibatch past this machine's memory",
         "args": run("bigP", "--rollout.prompts_per_step", "10000000")},
        {"name": "inference.port taken", "setup": lambda: run("port", "--inference.port", taken_port())},
        {"name": "model.path warm-started by another recipe", "setup": model_copy(
            "recipe", lambda d: None), "extra": ["--warmstart.demos", demos]},
        {"name": "task file not UTF-8", "args": run("utf8", *jsonl, "--task.path", write(
            "latin1.jsonl", b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "1"}\n'))},
        {"name": "a 10 MB row among good ones", "args": run("hugerow", *jsonl, "--task.path",
                                                            rows(work / "huge.jsonl", huge_row))},
        {"name": "verifier file with a syntax error", "args": run("syntax", "--task.verifier", write(
            "syntax.py", b"def verify(c, e):\n    return 1 +\n") + ":verify")},
        {"name": "verifier file that raises when imported", "args": run(
            "importraise", "--task.verifier", write("raising.py", b"import math\nvalue = math.sqrt(-1)\n")
            + ":value")},
        {"name": "config file not UTF-8", "args": ["train", write("c.toml", b'[run]\nname = "\xe9"\n')]},
        {"name": "run directory is a file", "args": ["train", *m[:2], "--run.root", str(work),
                                                     "--run.name", Path(write("afile", b"x")).name]},
        {"name": "ctl: a run that has ended", "setup": ended_run},
        {"name": "export: not a run directory", "args": ["export", str(work), str(work / "out")]},
        {"name": "export: no such step", "args": ["export", str(work / "runs" / "inf"), str(work / "out"),
                                                 "--step", "x"]},
    ]


def env(work: Path) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(work), str(ROOT)]))


def run_case(case: dict, work: Path) -> dict:
    start = time.monotonic()
    try:
        args = (case["setup"]() if "setup" in case else case["args"]) + case.get("extra", [])
    except Exception as e:
        return {"name": case["name"], "error": f"setup failed: {e}"}
    try:
        out = subprocess.run([sys.executable, "-m", "asyncrl.cli", *args], capture_output=True, text=True,
                             timeout=DEADLINE, env=env(work), cwd=work)
        code, stdout, stderr = out.returncode, out.stdout, out.stderr
    except subprocess.TimeoutExpired as e:
        code, stdout, stderr = "timeout", e.stdout or "", e.stderr or ""
        stdout, stderr = (s.decode() if isinstance(s, bytes) else s for s in (stdout, stderr))
    while TAKEN:
        TAKEN.pop().close()
    lines = stderr.strip().splitlines()
    first = max((i for i, line in enumerate(lines) if line.startswith("asyncrl")), default=len(lines) - 1)
    said = " ".join(line.strip() for line in lines[first:]) if lines else "(nothing)"
    run_dir = next((Path(a) for a in args if "/runs/" in str(a) and Path(a).is_dir()), None)
    name = args[args.index("--run.name") + 1] if "--run.name" in args else None
    run_dir = run_dir or (work / "runs" / name if name else None)
    events = run_dir / "events.jsonl" if run_dir else None
    return {
        "name": case["name"], "exit": code, "seconds": round(time.monotonic() - start, 1),
        "said": said[:400],
        "traceback": "Traceback" in stderr,
        "console_drop_lines": [line for line in stdout.splitlines() if line.startswith("! ")][:3],
        "resume_lines": [line for line in stdout.splitlines() if line.startswith("resume:")][:3],
        "events_bytes": events.stat().st_size if events and events.exists() else 0,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=str(ROOT / "models" / "tiny-default"))
    p.add_argument("--only", nargs="*")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="asyncrl-bad-"))
    (work / "bad_user_code.py").write_text(USER_CODE)
    results = []
    for case in cases(work, args.model):
        if args.only and case["name"] not in args.only:
            continue
        result = run_case(case, work)
        results.append(result)
        print(json.dumps(result), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "bad_inputs.json"
    if args.only and path.exists():  # re-run cases replace their rows; the others stay
        fresh = {r["name"]: r for r in results}
        order = [c["name"] for c in cases(work, args.model)]
        kept = {r["name"]: r for r in json.loads(path.read_text())}
        results = [fresh.get(name) or kept[name] for name in order if name in fresh or name in kept]
    path.write_text(json.dumps(results, indent=1))
    lines = ["| case | exit | seconds | what the user reads |", "|---|---|---|---|"]
    for r in results:
        said = r.get("error") or r["said"]
        extra = "; ".join(r.get("console_drop_lines", []) + r.get("resume_lines", []))
        lines.append(f"| {r['name']} | {r.get('exit')} | {r.get('seconds')} | {said}"
                     + (f" — console: {extra}" if extra else "") + " |")
    (RESULTS / "bad_inputs.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
