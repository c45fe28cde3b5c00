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
