"""Objective math against hand-computed values and an independent token-by-token computation."""
import dataclasses
import math

import pytest
import torch

from asyncrl.config.sections import ObjectiveConfig
from asyncrl.objectives import REGISTRY, get_objective
from asyncrl.objectives.common import LossInputs
from asyncrl.objectives.m2po import second_moment_keep
from asyncrl.trainer.step import aggregation_weights, collate, kl_penalty, loglinear_prox
from asyncrl.trajectory import Trajectory

CFG = ObjectiveConfig(eps_low=0.2, eps_high=0.28, behav_weight_cap=5.0, m2_threshold=0.04)
ln = math.log


TOP_SHIFTS = (0.0, 1.0, 2.5)  # the student's logprobs of the teacher's top-k ids: logp minus these
TEACHER_TOP = [math.log(p) for p in (0.5, 0.3, 0.1)]  # the teacher's top-3 logprobs at every position


def teacher_of(behav):
    """The teacher's logprob of each token in these tests: the sampler's, shifted by position."""
    return [[b - 0.1 * (t + 1) for t, b in enumerate(row)] for row in behav]


def make(logp, behav, prox, adv, mask=None, rewards=None, groups=None, dtype=torch.float64, teacher=None):
    t = lambda x: torch.tensor(x, dtype=dtype)  # noqa: E731
    logp = t(logp).requires_grad_(True)
    mask = t(mask) if mask is not None else torch.ones_like(logp)
    rows = logp.shape[0]
    rewards = t(rewards) if rewards is not None else torch.zeros(rows, dtype=dtype)
    groups = torch.tensor(groups if groups is not None else [0] * rows)
    teacher = t(teacher if teacher is not None else teacher_of(behav))
    top = t(TEACHER_TOP).expand(*logp.shape, len(TEACHER_TOP))
    top_logp = torch.stack([logp - s for s in TOP_SHIFTS], -1)  # (its gradient reaches logp)
    return LossInputs(logp, t(behav), t(prox), t(adv), mask, torch.zeros_like(mask), rewards, groups,
                      teacher, top, top_logp)


# --- by hand -----------------------------------------------------------------------------

def test_ppo_clip_by_hand():
    inp = make([[ln(1.5), ln(0.5), ln(1.1)]], [[0.0] * 3], [[0.0] * 3], [[1.0, -1.0, 1.0]])
    loss, metrics = get_objective("ppo_clip")(inp, CFG)
    # r=1.5, A=+1 -> clipped at 1.28; r=0.5, A=-1 -> clipped at 0.8; r=1.1 inside the region
    assert loss.detach()[0].tolist() == pytest.approx([-1.28, 0.8, -1.1])
    loss.sum().backward()
    assert inp.logp.grad[0].tolist() == pytest.approx([0.0, 0.0, -1.1])  # clipped: no gradient
    assert metrics["clip_high"] == pytest.approx(1 / 3) and metrics["clip_low"] == pytest.approx(1 / 3)


def test_dual_clip_bounds_negative_advantage_tokens():
    inp = make([[ln(10.0)]], [[0.0]], [[0.0]], [[-1.0]])
    loss, _ = get_objective("ppo_clip")(inp, CFG.model_copy(update={"dual_clip": 3.0}))
    assert loss.item() == pytest.approx(3.0)  # without dual clip: 10


def test_decoupled_ppo_by_hand():
    prox = [ln(2.0), ln(0.5), ln(10.0)]
    logp = [prox[0] + ln(1.1), prox[1] + ln(0.5), prox[2]]
    inp = make([logp], [[0.0] * 3], [prox], [[1.0, -1.0, 1.0]])
    loss, metrics = get_objective("decoupled_ppo")(inp, CFG)
    # w=2, r=1.1 -> -2.2;  w=0.5, r=0.5, A=-1 -> 0.5 * 0.8;  w=10 capped at 5, r=1 -> -5
    assert loss.detach()[0].tolist() == pytest.approx([-2.2, 0.4, -5.0])
    loss.sum().backward()
    assert inp.logp.grad[0].tolist() == pytest.approx([-2.2, 0.0, -5.0])
    assert metrics["behav_weight_capped"] == pytest.approx(1 / 3)


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    inp = make([[ln(1.5), ln(0.5)]], [[0.0, 0.0]], [[0.0, 0.0]], [[1.0, -1.0]])
    loss, _ = get_objective("cispo")(inp, CFG)
    loss.sum().backward()
    assert inp.logp.grad[0].tolist() == pytest.approx([-1.28, 0.8])  # −clip(r)·A, never 0


def test_sao_drops_both_sides():
    inp = make([[ln(1.5), ln(1.5), ln(0.5), ln(1.1)]], [[0.0] * 4], [[0.0] * 4], [[1.0, -1.0, 1.0, -1.0]])
    loss, metrics = get_objective("sao")(inp, CFG)
    # PPO would keep r=1.5 with A<0 and r=0.5 with A>0; SAO drops every token outside [0.8, 1.28]
    assert loss.detach()[0].tolist() == pytest.approx([0.0, 0.0, 0.0, 1.1])
    loss.sum().backward()
    assert inp.logp.grad[0].tolist() == pytest.approx([0.0, 0.0, 0.0, 1.1])
    assert metrics["clip_high"] == 0.5 and metrics["clip_low"] == 0.25


def test_opd_by_hand():
    behav, teacher = [[ln(0.5), ln(0.5), ln(0.5)]], [[ln(0.8), ln(0.2), ln(0.8)]]
    prox = [[ln(0.5), ln(0.5), ln(0.2)]]  # the third: the trainer's 0.2 against the engine's 0.5
    inp = make(behav, behav, prox, [[0.0] * 3], teacher=teacher)
    loss, metrics = get_objective("opd")(inp, CFG)
    # A = ln(0.8/0.5) where the teacher likes the token more, ln(0.2/0.5) where less; r = 1
    assert loss.detach()[0].tolist() == pytest.approx([-ln(1.6), -ln(0.4), 0.0])
    assert metrics["opd_masked"] == pytest.approx(1 / 3)
    assert metrics["reverse_kl"] == pytest.approx((ln(0.5 / 0.8) + ln(0.5 / 0.2) + ln(0.5 / 0.8)) / 3)
    loss.sum().backward()
    assert inp.logp.grad[0].tolist() == pytest.approx([-ln(1.6), -ln(0.4), 0.0])


def test_distilling_objectives_need_the_teachers_fields():
    inp = make([[-0.5]], [[-0.5]], [[-0.5]], [[1.0]])
    for name, field in [("opd", "teacher"), ("rl_opd", "teacher"), ("opd_topk", "teacher_top")]:
        with pytest.raises(ValueError, match="teacher"):
            get_objective(name)(dataclasses.replace(inp, **{field: None}), CFG)


def test_gspo_sequence_ratio():
    # mean log-ratio 0 → s = 1, inside the tiny clip band: loss = −A on every token
    inp = make([[0.1, -0.1], [0.2, 0.0]], [[0.0, 0.0]] * 2, [[0.0, 0.0]] * 2, [[2.0, 2.0], [1.0, 1.0]])
    loss, metrics = get_objective("gspo")(inp, CFG)
    s2 = math.exp(0.1)
    assert loss.detach().flatten().tolist() == pytest.approx([-2.0, -2.0, -(1 + 4e-4), -(1 + 4e-4)])
    assert metrics["clip_high"] == 0.5 and s2 > 1 + 4e-4


def test_tis_and_mis_levels():
    behav = [[0.0, 0.0]]
    prox = [[ln(3.0), ln(0.9)]]  # ρ = 3 and 0.9 at token level; 2.7 per sequence; √2.7 geometric
    adv = [[1.0, 1.0]]
    tis = get_objective("tis")
    mis = get_objective("mis")
    for level, rho in [("token", [3.0, 0.9]), ("sequence", [2.7, 2.7]), ("geometric", [2.7**0.5] * 2)]:
        cfg = CFG.model_copy(update={"is_level": level})
        loss, _ = tis(make(prox, behav, prox, adv), cfg)  # logp = prox: r = 1, loss_t = −min(ρ, 2)
        assert loss.detach()[0].tolist() == pytest.approx([-min(r, 2.0) for r in rho])
        loss, m = mis(make(prox, behav, prox, adv), cfg)  # masked outside [0.5, 2], else −ρ
        assert loss.detach()[0].tolist() == pytest.approx([-r if 0.5 <= r <= 2.0 else 0.0 for r in rho])


def test_m2po_masks_fewest_largest_second_moments():
    m2 = torch.tensor([[0.5, 0.01, 0.02], [0.03, 0.2, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    keep = second_moment_keep(m2, mask, threshold=0.04)
    # mean of 5 counted = 0.152 > 0.04; drop 0.5 → 0.065; drop 0.2 too → 0.02 ≤ 0.04
    assert keep.tolist() == [[False, True, True], [True, False, False]]
    assert second_moment_keep(m2, mask, threshold=1.0).tolist() == (mask > 0).tolist()
    everything_big = second_moment_keep(torch.full((1, 3), 9.0), torch.ones(1, 3), 0.04)
    assert everything_big.sum() == 1  # never mask every token


def test_vcpo_baseline_and_step_scale():
    # on-policy (w_i = 1): the baseline is the group mean, ESS = B, lr_scale = 1
    inp = make([[-0.5], [-0.5], [-0.5], [-0.5]], [[-0.5]] * 4, [[-0.5]] * 4, [[9.0]] * 4,
               rewards=[1.0, 0.0, 1.0, 1.0], groups=[0, 0, 1, 1])
    loss, metrics = get_objective("vcpo")(inp, CFG)
    assert [row[0] for row in loss.detach().tolist()] == pytest.approx([-0.5, 0.5, 0.0, 0.0])
    assert metrics["lr_scale"] == pytest.approx(1.0)
    # one sequence far more likely now than when sampled dominates the baseline and ESS drops
    inp = make(
        [[0.0], [-2.0]], [[-2.0], [-2.0]], [[0.0], [-2.0]], [[0.0]] * 2, rewards=[1.0, 0.0], groups=[0, 0]
    )
    loss, metrics = get_objective("vcpo")(inp, CFG)
    w = [math.exp(0.0), math.exp(-2.0)]  # normalised by the max: e^2 → 1, 1 → e^-2
    b = (w[0] ** 2 * 1.0) / (w[0] ** 2 + w[1] ** 2)
    ess = (w[0] + w[1]) ** 2 / (w[0] ** 2 + w[1] ** 2) / 2
    assert metrics["vcpo_ess_fraction"] == pytest.approx(ess)
    assert metrics["lr_scale"] == pytest.approx(math.sqrt(ess))
    assert loss.detach()[1, 0].item() == pytest.approx(-(0.0 - b))  # A = R − b, r = w = 1 for row 2


# --- against an independent computation, with edge cases ----------------------------------

def reference(name, logp, behav, prox, adv, mask, rewards, groups, cfg):
    """Token-by-token straightforward Python, per row; returns [rows][tokens] (masked: None)."""
    rows, out = len(logp), []
    clipped = lambda r, a: -min(r * a, min(max(r, 1 - cfg.eps_low), 1 + cfg.eps_high) * a)  # noqa: E731
    counted = lambda i: [t for t in range(len(logp[i])) if mask[i][t]]  # noqa: E731
    if name == "vcpo":
        logw = [sum(logp[i][t] - behav[i][t] for t in counted(i)) for i in range(rows)]
        w2 = [math.exp(2 * (x - max(logw))) for x in logw]
        base = {g: sum(w2[i] * rewards[i] for i in range(rows) if groups[i] == g) /
                sum(w2[i] for i in range(rows) if groups[i] == g) for g in set(groups)}
    if name == "m2po":
        m2 = sorted(((behav[i][t] - prox[i][t]) ** 2, i, t) for i in range(rows) for t in counted(i))[::-1]
        dropped = set()
        while m2 and len(m2) > 1 and sum(v for v, *_ in m2) / len(m2) > cfg.m2_threshold:
            dropped.add(m2.pop(0)[1:])
    for i in range(rows):
        row = []
        for t in range(len(logp[i])):
            if not mask[i][t]:
                row.append(None)
                continue
            a, r_b, r_p = adv[i][t], math.exp(logp[i][t] - behav[i][t]), math.exp(logp[i][t] - prox[i][t])
            w = min(math.exp(prox[i][t] - behav[i][t]), cfg.behav_weight_cap)
            teach = teacher_of(behav)[i][t]
            if name in ("ppo_clip", "dr_grpo"):
                v = clipped(r_b, a)
            elif name == "decoupled_ppo":
                v = w * clipped(r_p, a)
            elif name == "tis":
                v = min(math.exp(prox[i][t] - behav[i][t]), cfg.is_cap) * clipped(r_p, a)
            elif name == "mis":
                rho = math.exp(prox[i][t] - behav[i][t])
                v = rho * clipped(r_p, a) if cfg.is_low <= rho <= cfg.is_high else 0.0
            elif name == "gspo":
                s = math.exp(sum(logp[i][k] - prox[i][k] for k in counted(i)) / len(counted(i)))
                ws = min(
                    math.exp(sum(prox[i][k] - behav[i][k] for k in counted(i)) / len(counted(i))),
                    cfg.behav_weight_cap,
                )
                v = -ws * min(s * a, min(max(s, 1 - cfg.gspo_eps_low), 1 + cfg.gspo_eps_high) * a)
            elif name == "m2po":
                v = 0.0 if (i, t) in dropped else w * clipped(r_p, a)
            elif name == "vcpo":
                v = w * clipped(r_p, rewards[i] - base[groups[i]])
            elif name == "sao":
                v = -r_b * a if 1 - cfg.eps_low <= r_b <= 1 + cfg.eps_high else 0.0
            elif name == "cispo":
                v = -min(max(r_b, 1 - cfg.eps_low), 1 + cfg.eps_high) * a * logp[i][t]
            elif name == "opd":
                agree = math.exp(prox[i][t]) >= math.exp(behav[i][t]) - cfg.opd_mismatch
                v = -min(r_b, cfg.behav_weight_cap) * (teach - behav[i][t]) if agree else 0.0
            elif name == "rl_opd":
                v = w * clipped(r_p, a - cfg.opd_coef * (behav[i][t] - teach))
            elif name == "opd_topk":
                p = [math.exp(x) / sum(map(math.exp, TEACHER_TOP)) for x in TEACHER_TOP]
                v = sum(pj * (math.log(pj) - (logp[i][t] - s)) for pj, s in zip(p, TOP_SHIFTS))
            row.append(v)
        out.append(row)
    return out


INF, NAN = float("inf"), float("nan")
CASES = {
    "mixed": dict(
        logp=[[-0.2, -1.0, -0.7, NAN], [-0.4, -0.3, INF, -INF], [-1.1, -0.05, -0.3, -0.9]],
        behav=[[-0.25, -0.8, -0.7, 0.0], [-0.5, -0.2, 0.0, 0.0], [-1.0, -0.1, -0.6, -0.4]],
        prox=[[-0.22, -0.9, -0.72, 0.0], [-0.42, -0.25, 0.0, 0.0], [-1.05, -0.07, -0.4, -0.6]],
        adv=[[1.0, 1.0, 1.0, 0.0], [-0.5, -0.5, 0.0, 0.0], [0.8, 0.8, 0.8, 0.8]],
        mask=[[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]],
        rewards=[1.0, 0.0, 1.0],
        groups=[0, 0, 1],
    ),
    "fully_masked_row": dict(
        logp=[[-0.3, -0.2], [NAN, INF]],
        behav=[[-0.35, -0.1], [0.0, 0.0]],
        prox=[[-0.3, -0.15], [0.0, 0.0]],
        adv=[[1.0, 1.0], [0.0, 0.0]],
        mask=[[1, 1], [0, 0]],
        rewards=[1.0, 0.0],
        groups=[0, 0],
    ),
    "single_token": dict(
        logp=[[-0.5]], behav=[[-0.45]], prox=[[-0.48]], adv=[[-1.0]], mask=[[1]], rewards=[0.0], groups=[0]
    ),
    "zero_advantages": dict(
        logp=[[-0.5, -0.2], [-0.1, -0.9]],
        behav=[[-0.4, -0.3], [-0.2, -0.5]],
        prox=[[-0.45, -0.25], [-0.1, -0.7]],
        adv=[[0.0, 0.0], [0.0, 0.0]],
        mask=[[1, 1], [1, 1]],
        rewards=[1.0, 1.0],
        groups=[0, 0],
    ),
    "ratios_near_0_and_inf": dict(
        logp=[[-30.0, -0.1], [-0.1, -0.2]],
        behav=[[-0.1, -30.0], [-0.1, -0.2]],
        prox=[[-0.1, -30.0], [-0.1, -0.2]],
        adv=[[1.0, 1.0], [-1.0, 1.0]],
        mask=[[1, 1], [1, 1]],
        rewards=[1.0, 0.0],
        groups=[0, 0],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_matches_independent_computation(name, case):
    c = CASES[case]
    inp = make(c["logp"], c["behav"], c["prox"], c["adv"], c["mask"], c["rewards"], c["groups"])
    loss, metrics = get_objective(name)(inp, CFG)
    expected = reference(name, **c, cfg=CFG)
    for i, row in enumerate(expected):
        for t, v in enumerate(row):
            if v is None:
                continue
            assert loss[i, t].item() == pytest.approx(v, rel=1e-6, abs=1e-9), (name, case, i, t)
    counted = inp.mask > 0
    assert torch.isfinite(torch.where(counted, loss, 0.0)).all() or case == "ratios_near_0_and_inf"
    total = torch.where(counted, loss, 0.0).sum()
    total.backward()
    assert not torch.isnan(inp.logp.grad[counted]).any()
    assert all(math.isfinite(v) for v in metrics.values())
    # (vcpo forms its own advantages from rewards, the distilling objectives from the teacher)
    if case == "zero_advantages" and name not in ("vcpo", "opd", "rl_opd", "opd_topk"):
        assert total.item() == 0.0 and inp.logp.grad.abs().sum() == 0


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_on_policy_reduces_to_the_policy_gradient(name):
    """behaviour = proximal = current policy: the gradient of the summed loss is −A per token
    (GSPO: its sequence loss sits on each of |τ| tokens and each gets 1/|τ| of the gradient of
    each; VCPO: A is R minus its baseline, the group mean)."""
    logp = [[-0.3, -1.2, -2.0], [-0.1, -0.7, -0.4]]
    adv = [[1.5, 1.5, 1.5], [-0.5, -0.5, 0.0]]
    mask = [[1, 1, 1], [1, 1, 0]]
    rewards, groups = [1.0, 0.0], [0, 0]
    inp = make(logp, logp, logp, adv, mask, rewards, groups)
    loss, _ = get_objective(name)(inp, CFG)
    torch.where(inp.mask > 0, loss, 0.0).sum().backward()
    teach = teacher_of(logp)
    if name == "vcpo":
        expected = [[-0.5] * 3, [0.5, 0.5, 0.0]]  # A = R − mean(R) = ±0.5
    elif name == "opd":  # A_t = teach_t − logp_t, the token's negative reverse KL
        expected = [[-(k - lp) * m for k, lp, m in zip(rk, rl, rm)] for rk, rl, rm in zip(teach, logp, mask)]
    elif name == "rl_opd":  # A_t − λ(logp_t − teach_t), λ = 1
        expected = [[-(a - (lp - k)) * m for a, k, lp, m in zip(ra, rk, rl, rm)]
                    for ra, rk, rl, rm in zip(adv, teach, logp, mask)]
    elif name == "opd_topk":  # −Σ_j p̂_j: the student's logprob of each top-k id moves with logp here
        expected = [[-1.0 * m for m in rm] for rm in mask]
    else:
        expected = [[-a * m for a, m in zip(ra, rm)] for ra, rm in zip(adv, mask)]
    assert inp.logp.grad.tolist() == [pytest.approx(row) for row in expected]


def test_user_objective_by_import_path():
    fn = get_objective("ignored", "asyncrl.objectives.ppo_clip:loss")
    assert fn is get_objective("ppo_clip")


# --- trainer-side pieces ------------------------------------------------------------------

def test_loglinear_prox():
    behav = torch.tensor([-1.0, -1.0, -1.0])
    logp = torch.tensor([-2.0, -2.0, -2.0])
    stale = torch.tensor([0.0, 1.0, 3.0])
    # α = s / (s + 1): fresh tokens keep behav; 1 version old sits halfway; 3 versions old 3/4
    assert loglinear_prox(behav, logp, stale).tolist() == pytest.approx([-1.0, -1.5, -1.75])


def test_aggregation_weights():
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    expected = {"token_mean": [0.2] * 5, "seq_mean": [0.125] * 4 + [0.5], "constant": [0.125] * 5}
    for mode, values in expected.items():
        w = aggregation_weights(mask, mode)
        assert w[mask > 0].tolist() == pytest.approx(values) and w[mask == 0].abs().sum() == 0


def test_kl_estimators():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    d = -0.5  # log π_ref/π_θ
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * d * d)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(math.exp(d) - 1 - d)


def test_collate_aligns_tokens_with_next_token_logits():
    t = Trajectory(
        "a",
        "g",
        "t",
        0,
        tokens=[1, 5, 6, 7],
        loss_mask=[0, 0, 1, 1],
        logprobs=[0.0, 0.0, -0.5, -0.7],
        versions=[-1, -1, 3, 4],
        reward=1.0,
        advantages=[0, 0, 2.0, 2.0],
    )
    short = Trajectory("b", "h", "t", 1, tokens=[1, 5, 6], loss_mask=[0, 0, 1],
                       logprobs=[0.0, 0.0, -0.1], versions=[-1, -1, 4], advantages=[0, 0, -1.0])
    b = collate([t, short], pad_id=0, version=5)
    assert b["targets"].tolist() == [[5, 6, 7], [5, 6, 0]]
    assert b["mask"].tolist() == [[0, 1, 1], [0, 1, 0]]
    assert torch.allclose(b["behav"], torch.tensor([[0, -0.5, -0.7], [0, -0.1, 0]]))
    assert b["staleness"].tolist() == [[0, 2, 1], [0, 1, 0]]
    assert b["attention"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert b["rewards"].tolist() == [1.0, 0.0] and b["groups"].tolist() == [0, 1]
