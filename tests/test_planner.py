"""asyncrl plan: the simulator runs the orchestrator's rules on rate models (docs/planner.md).

Deterministic: simulated time only, no processes. Whether its predictions match measured runs is
benchmarks/plan_validation.py's question, not a test's."""
import json

import pytest

from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.observe.fit import LinearFit, solve
from asyncrl.plan.rates import Rates
from asyncrl.plan.simulate import simulate
from asyncrl.plan.workload import Workload

RATES = Rates(decode_base=0.004, decode_per_row=0.0001, prefill_base=0.002, prefill_per_token=0.00001,
              load_seconds=0.003, step_base=0.02, step_per_token=0.0001, group_seconds=0.0005,
              handoff_seconds=0.001)
UNIFORM = Workload(prompt=[[10, 10, 1]], answer=[[4, 4, 1]])
LONG_TAIL = Workload(prompt=[[10, 10, 1]], answer=[[3, 7, 7], [17, 31, 1]], shared=True)


def cfg(eta: int, steps: int = 40, **more):
    args = ["--rollout.max_staleness", str(eta), "--run.steps", str(steps), "--rollout.prompts_per_step", "4",
            "--rollout.group_size", "4", "--inference.update_policy", "keep"]
    return load_config(overrides=args + [x for k, v in more.items() for x in (f"--{k}", str(v))])


def test_a_line_is_read_back_from_its_sums():
    fit = LinearFit()
    for x in (1, 4, 9, 16):
        fit.add(x, 0.5 + 0.25 * x)
    assert solve(fit.sums) == pytest.approx((0.5, 0.25))
    one_x = LinearFit()
    for t in (1.0, 3.0):
        one_x.add(8, t)
    assert solve(one_x.sums) == (2.0, 0.0)  # (a slope needs two batch sizes: the mean stands alone)


def test_synchronous_steps_take_the_sum_of_their_phases():
    """η = 0: each version is handed over, loaded, the batch prefilled once per prompt and decoded
    token by token, every group scored, then trained: nothing overlaps."""
    r, groups, g, answer, prompt = RATES, 4, 4, 4, 10
    decode = answer * (r.decode_base + r.decode_per_row * groups * g)
    prefill = r.prefill_base + r.prefill_per_token * prompt * groups
    train = r.step_base + r.step_per_token * groups * g * answer
    step = r.handoff_seconds + r.load_seconds + prefill + decode + r.group_seconds + train
    out = simulate(cfg(0), RATES, UNIFORM)
    gaps = [b - a for a, b in zip(out["times"], out["times"][1:])]
    assert gaps == pytest.approx([step] * len(gaps))
    assert out["staleness_hist"] == {"0": 40 * 16} and out["dropped_stale_groups"] == 0


@pytest.mark.parametrize("eta", [0, 1, 4, 16])
def test_the_staleness_bound_holds_and_every_sample_is_trained_once(eta):
    out = simulate(cfg(eta), RATES, LONG_TAIL)
    hist = {int(k): v for k, v in out["staleness_hist"].items()}
    assert max(hist) <= eta and sum(hist.values()) == 40 * 16


def test_overlap_is_bound_by_the_slower_role():
    """η ≥ 1 with a slow trainer: a step takes the training step, and generation hides behind it."""
    slow = Rates(**{**vars(RATES), "step_base": 0.5})
    out = simulate(cfg(2, steps=60), slow, UNIFORM)
    train = slow.step_base + slow.step_per_token * 64
    assert out["samples_per_s"] == pytest.approx(16 / train, rel=0.03)
    assert out["trainer_busy_fraction"] > 0.95 and out["inference_busy_fraction"] < 0.2


def test_a_second_replica_halves_an_inference_bound_step():
    """Each replica decodes half the rows; with the cost per row dominant, a step takes half as long."""
    slow = Rates(**{**vars(RATES), "decode_per_row": 0.005, "step_base": 0.001, "step_per_token": 0.0})
    one, two = (simulate(cfg(1, steps=60, **{"rollout.prompts_per_step": 8}), slow, UNIFORM, replicas=n)
                for n in (1, 2))
    assert two["samples_per_s"] / one["samples_per_s"] == pytest.approx(2.0, rel=0.1)


def test_asynchrony_pays_on_a_long_tail():
    sync, overlap = (simulate(cfg(eta, steps=60), RATES, LONG_TAIL)["samples_per_s"] for eta in (0, 4))
    assert overlap > 1.3 * sync


def test_agent_turns_wait_for_their_tools():
    agent = Workload(prompt=[[10, 10, 1]], answer=[[4, 4, 1]], turns=3, tool_seconds=0.2, tool_tokens=5)
    out = simulate(cfg(0, steps=5), RATES, agent)
    gaps = [b - a for a, b in zip(out["times"], out["times"][1:])]
    assert min(gaps) > 2 * 0.2  # (two tool calls per episode, in every step)


def test_plan_command_predicts_and_recommends(tmp_path, capsys):
    RATES.write(tmp_path / "rates.json")
    (tmp_path / "w.json").write_text(json.dumps({"prompt": [[10, 10, 1]], "answer": [[3, 7, 7], [17, 31, 1]],
                                                 "shared": True}))
    code = main(["plan", "--rates", str(tmp_path / "rates.json"), "--workload", str(tmp_path / "w.json"),
                 "--devices", "3", "--etas", "0,2", "--run.steps", "20"])
    out = capsys.readouterr().out
    assert code == 0 and out.count("\n| ") == 2 * 2 and "recommended:" in out  # (2 splits × 2 η)


@pytest.mark.parametrize("rates, said", [
    ({"decode_base": 0.1}, "missing decode_per_row"),
    ({**vars(RATES), "speed": 3}, "unknown speed"),
    ({**vars(RATES), "step_base": -1}, "not so: step_base"),
])
def test_a_bad_rates_file_is_named(tmp_path, capsys, rates, said):
    (tmp_path / "rates.json").write_text(json.dumps(rates))
    assert main(["plan", "--rates", str(tmp_path / "rates.json")]) == 2
    assert said in capsys.readouterr().err


def test_a_bad_workload_is_named(tmp_path, capsys):
    RATES.write(tmp_path / "rates.json")
    (tmp_path / "w.json").write_text(json.dumps({"answer": [[9, 2, 1]]}))
    args = ["plan", "--rates", str(tmp_path / "rates.json"), "--workload", str(tmp_path / "w.json")]
    assert main(args) == 2
    assert "workload.answer must be" in capsys.readouterr().err
