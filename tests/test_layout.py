"""The package's shape: folders by concern, no import circles, every file of a run named in one module
(asyncrl/rundir.py), and the page that documents a run directory generated from it."""
import ast
import re
from pathlib import Path

from asyncrl import rundir
from asyncrl.rundir import CheckpointFiles, RunDir, RunRoot

PACKAGE = Path(__file__).resolve().parent.parent / "asyncrl"
# names a model directory has too (a checkpoint is one): joining them to a model's path is not a run's format
MODEL_FILES = {"config.json", "model.safetensors", "tokenizer*"}


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path) -> set[str]:
    """The package's modules `path` imports, at its top or in a function (a lazy import is an edge too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                      for a in node.names}
    return {name for name in found if name in MODULES}


GRAPH = {name: _imports(path) - {name} for name, path in MODULES.items()}


def _cycle() -> list[str] | None:
    """One import circle, as the modules around it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for nxt in sorted(GRAPH[name]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[name] = 2
        return None

    for name in sorted(GRAPH):
        if name not in state and (found := visit(name)):
            return found
    return None


def test_no_import_circles():
    assert _cycle() is None, " -> ".join(_cycle())


def test_the_top_level_holds_few_modules_and_the_folders_show_the_concerns():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 8, top
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert {"run", "cluster", "transports", "observe", "control", "config", "store", "orchestrator",
            "trainer", "inference", "agents", "objectives", "rewards"} <= folders


def test_lower_layers_do_not_import_the_launcher_or_the_ray_roles():
    """The launcher picks local or Ray hosts and hands them to the supervisor: nothing under it reaches up."""
    for name, imported in GRAPH.items():
        if name.startswith("asyncrl.cluster") or name == "asyncrl.run.launcher" or name == "asyncrl.cli":
            continue
        above = {i for i in imported if i.startswith("asyncrl.cluster") or i in ("asyncrl.run.launcher",
                                                                                     "asyncrl.cli")}
        assert not above, f"{name} imports {above}"


def _table_paths() -> list[str]:
    """The paths the on-disk format tables list, as written (`logs/{role}.log`, `ledger.db`, ...)."""
    paths = []
    for cell in re.findall(r"^\| `([^|]+?)` ?(?:\([^|]*\))? ?\|", rundir.__doc__, flags=re.M):
        paths += [p.strip().rstrip("/") for p in re.split(r"`, `", cell)]
    return paths


def _pattern(path: str) -> re.Pattern:
    return re.compile(re.sub(r"\\\{[^}]*\\\}|\\\*", ".+", re.escape(path)))


def _run_file_names() -> set[str]:
    """The file and folder names in those paths, but a bare `{role}` or `{index}.json` (and the names any
    model directory has)."""
    names = {part for path in _table_paths() for part in path.split("/")}
    return {n for n in names if not re.fullmatch(r"\{\w+\}(\.\w+)?", n)} - MODEL_FILES


def test_no_other_module_joins_a_run_file_name_to_a_path():
    names = _run_file_names()
    assert {"ledger.db", "metrics.jsonl", "pids.json", "heartbeats", "manifest.json"} <= names
    literal = {n for n in names if "{" not in n}
    patterns = [_pattern(n) for n in names if "{" in n]
    found = []
    for name, path in MODULES.items():
        if name == "asyncrl.rundir":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
                right = node.right
                text = (right.value if isinstance(right, ast.Constant) and isinstance(right.value, str)
                        else "".join(v.value for v in right.values if isinstance(v, ast.Constant))
                        if isinstance(right, ast.JoinedStr) else None)
                formatted = isinstance(right, ast.JoinedStr) and text.startswith(("step_", "v"))
                if text is not None and (text in literal or formatted
                                         or any(p.fullmatch(text) for p in patterns)):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} / {text!r}")
    assert not found, "run files named outside asyncrl/rundir.py:\n" + "\n".join(found)


def test_every_path_the_run_dir_gives_is_in_its_table(tmp_path):
    run, root, ckpt = RunDir(tmp_path / "job"), RunRoot(tmp_path), CheckpointFiles(tmp_path / "c")
    given = {run.path: [run.config, run.token, run.thread_plan, run.pids, run.summary, run.report_md,
                        run.report_png, run.ledger, run.metrics, run.events, run.batch(3),
                        run.weights_file(2), run.patch(2), run.marker(2), run.spare, run.checkpoint(4),
                        run.log("trainer"),
                        run.heartbeat("trainer"), run.replica(1), run.trainer_info, run.weight_sender,
                        run.control, run.paused, run.failure, run.tensorboard, run.wandb],
             root.path: [run.lock, root.thread_plans, root.thread_plans_lock],
             ckpt.path: [ckpt.model, ckpt.config, ckpt.optimizer, ckpt.trainer_state, ckpt.manifest]}
    patterns = [_pattern(p) for p in _table_paths()]
    for base, paths in given.items():
        for path in paths:
            relative = str(path.relative_to(base))
            assert any(p.fullmatch(relative) for p in patterns), f"{relative}: not in rundir.py's table"
    assert run.batch(7) == tmp_path / "job" / "batches" / "step_000007.jsonl"
    assert run.checkpoint(7) == tmp_path / "job" / "checkpoints" / "step_000007"
    assert run.lock == tmp_path / ".job.lock"


def test_the_run_directory_page_is_generated_from_the_module():
    page = (PACKAGE.parent / "docs" / "run_directory.md").read_text()
    assert page == rundir.page(), "stale: python -m asyncrl.rundir > docs/run_directory.md"
