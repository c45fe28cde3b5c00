"""Objective math against values computed by hand."""
import math

import pytest
import torch

from asyncrl.config import ObjectiveConfig
from asyncrl.objectives import REGISTRY, get_objective
from asyncrl.objectives.common import LossInputs
from asyncrl.trainer.step import collate, loglinear_prox
from asyncrl.trajectory import Trajectory

CFG = ObjectiveConfig(eps_low=0.2, eps_high=0.28, behav_weight_cap=5.0)


def inputs(logp, behav, prox, adv, staleness=None):
    logp = torch.tensor([logp], requires_grad=True)
    t = lambda x: torch.tensor([x], dtype=torch.float32)  # noqa: E731
    mask = torch.ones_like(logp)
    return LossInputs(logp, t(behav), t(prox), t(adv), mask, t(staleness or [0.0] * len(adv)))


def test_ppo_clip_by_hand():
    ln = math.log
    inp = inputs([ln(1.5), ln(0.5), ln(1.1)], [0.0] * 3, [0.0] * 3, [1.0, -1.0, 1.0])
    loss, metrics = get_objective("ppo_clip")(inp, CFG)
    # r=1.5, A=+1 -> clipped at 1.28; r=0.5, A=-1 -> clipped at 0.8; r=1.1 inside the region
    assert loss.detach()[0].tolist() == pytest.approx([-1.28, 0.8, -1.1], abs=1e-6)
    loss.sum().backward()
    assert inp.logp.grad[0].tolist() == pytest.approx([0.0, 0.0, -1.1], abs=1e-6)  # clipped: no gradient
    assert metrics["clip_high"] == pytest.approx(1 / 3) and metrics["clip_low"] == pytest.approx(1 / 3)


def test_decoupled_ppo_by_hand():
    ln = math.log
    prox = [ln(2.0), ln(0.5), ln(10.0)]
    logp = [prox[0] + ln(1.1), prox[1] + ln(0.5), prox[2]]
    inp = inputs(logp, [0.0] * 3, prox, [1.0, -1.0, 1.0])
    loss, metrics = get_objective("decoupled_ppo")(inp, CFG)
    # w=2, r=1.1 -> -2.2;  w=0.5, r=0.5, A=-1 -> 0.5 * 0.8;  w=10 capped at 5, r=1 -> -5
    assert loss.detach()[0].tolist() == pytest.approx([-2.2, 0.4, -5.0], abs=1e-5)
    loss.sum().backward()
    assert inp.logp.grad[0].tolist() == pytest.approx([-2.2, 0.0, -5.0], abs=1e-5)
    assert metrics["behav_weight_capped"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_on_policy_reduces_to_policy_gradient(name):
    """behaviour = proximal = current policy: gradient of the token loss is −A ∂logp."""
    logp_values = [-0.3, -1.2, -2.0, -0.1]
    adv = [1.5, -0.5, 0.0, -2.0]
    inp = inputs(logp_values, logp_values, logp_values, adv)
    loss, _ = get_objective(name)(inp, CFG)
    loss.sum().backward()
    assert inp.logp.grad[0].tolist() == pytest.approx([-a for a in adv], abs=1e-6)


def test_loglinear_prox():
    behav = torch.tensor([-1.0, -1.0, -1.0])
    logp = torch.tensor([-2.0, -2.0, -2.0])
    stale = torch.tensor([0.0, 1.0, 3.0])
    # α = s / (s + 1): fresh tokens keep behav; 1 version old sits halfway; 3 versions old 3/4
    assert loglinear_prox(behav, logp, stale).tolist() == pytest.approx([-1.0, -1.5, -1.75])


def test_collate_aligns_tokens_with_next_token_logits():
    t = Trajectory("a", "g", "t", 0, tokens=[1, 5, 6, 7], loss_mask=[0, 0, 1, 1],
                   logprobs=[0.0, 0.0, -0.5, -0.7], versions=[-1, -1, 3, 4], advantages=[0, 0, 2.0, 2.0])
    short = Trajectory("b", "g", "t", 0, tokens=[1, 5, 6], loss_mask=[0, 0, 1],
                       logprobs=[0.0, 0.0, -0.1], versions=[-1, -1, 4], advantages=[0, 0, -1.0])
    b = collate([t, short], pad_id=0, version=5)
    assert b["targets"].tolist() == [[5, 6, 7], [5, 6, 0]]
    assert b["mask"].tolist() == [[0, 1, 1], [0, 1, 0]]
    assert torch.allclose(b["behav"], torch.tensor([[0, -0.5, -0.7], [0, -0.1, 0]]))
    assert b["staleness"].tolist() == [[0, 2, 1], [0, 1, 0]]
    assert b["attention"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
