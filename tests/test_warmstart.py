"""The supervised warm start from an existing policy (warmstart.base)."""
import pytest
import torch

from asyncrl.config import load_config
from asyncrl.policy.model import load_policy
from asyncrl.policy.warmstart import warmstart


def test_a_warm_start_from_a_base_fine_tunes_its_weights_with_its_tokenizer(tiny_model, tmp_path):
    cfg = load_config(overrides=["--warmstart.base", tiny_model, "--warmstart.steps", "2", "--warmstart.lr",
                                 "1e-4", "--warmstart.batch_size", "4", "--task.eval_size", "8"])
    summary = warmstart(cfg, tmp_path / "tuned", log=lambda *a, **k: None)
    base, base_tok = load_policy(tiny_model)
    tuned, tuned_tok = load_policy(tmp_path / "tuned")
    assert (summary["steps"], summary["tokenizer"]) == (2, tiny_model)
    assert tuned_tok.get_vocab() == base_tok.get_vocab()
    pairs = list(zip(base.state_dict().values(), tuned.state_dict().values()))
    # two small steps away from the base: every tensor near it, some moved (a fresh model is nowhere near)
    assert all((b - t).abs().max() < 1e-2 for b, t in pairs)
    assert any(not torch.equal(b, t) for b, t in pairs)


def test_a_missing_base_is_named(tmp_path):
    cfg = load_config(overrides=["--warmstart.base", str(tmp_path / "nothing")])
    with pytest.raises(FileNotFoundError, match="warmstart.base"):
        warmstart(cfg, tmp_path / "out", log=lambda *a, **k: None)


SMALL = ["--warmstart.steps", "40", "--warmstart.batch_size", "8", "--warmstart.hidden_size", "16",
         "--warmstart.layers", "1", "--warmstart.heads", "2", "--warmstart.kv_heads", "1",
         "--warmstart.vocab_size", "300", "--task.eval_size", "8"]


def test_a_build_cut_short_is_recorded_as_such_and_built_again(tmp_path):
    from asyncrl.policy.warmstart import COMPLETE, CUT_SHORT, MISSING, build_state
    from asyncrl.run.preflight import build_policy

    path = tmp_path / "tiny"
    short = load_config(overrides=[*SMALL, "--warmstart.max_seconds", "0.001"])
    assert build_state(short, path) == MISSING
    summary = warmstart(short, path, log=lambda *a, **k: None)
    assert not summary["complete"] and build_state(short, path) == CUT_SHORT
    said = []
    build_policy(load_config(overrides=SMALL), path, log=said.append)  # (the same recipe: max_seconds aside)
    assert any("was cut short" in line for line in said)
    assert build_state(load_config(overrides=SMALL), path) == COMPLETE
    assert not list(tmp_path.glob(".tiny.partial*"))  # (written beside, renamed into place)


def test_two_processes_needing_one_policy_build_it_once(tmp_path):
    """Two launchers at once (two README commands in two terminals): one builds, the other waits on the
    build's lock, saying so, and uses what it built."""
    import subprocess
    import sys

    code = ("import sys; from pathlib import Path; from asyncrl.config import load_config; "
            "from asyncrl.run.preflight import build_policy; "
            f"build_policy(load_config(overrides={SMALL!r}), Path(sys.argv[1]), log=print)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "tiny")], stdout=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert sum("building the tiny policy first" in out for out in outputs) == 1, outputs
    other = next(out for out in outputs if "building the tiny policy first" not in out)
    # it waited on the lock and used the result, or (started late) found the build already complete
    assert ("waiting for the build of" in other and "built by another process meanwhile" in other) or \
        other.strip() == "", other
