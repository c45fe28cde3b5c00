"""The pieces issue 7 added for speed: where time goes, length buckets, the thread plan, batched scoring."""
import asyncio
import random
import subprocess
import sys

import pytest
import torch

from asyncrl.config.sections import TaskConfig
from asyncrl.observe.report import profile, profile_summary
from asyncrl.policy.model import build_char_tokenizer, build_tiny_model
from asyncrl.rewards.pool import VerifierError, VerifierPool
from asyncrl.run.threads import ALTERNATE, choose
from asyncrl.trainer.logprobs import CALL_COST_TOKENS, length_buckets, token_logprobs
from asyncrl.trainer.step import collate
from asyncrl.trajectory import Trajectory


def test_length_buckets_cover_every_row_once_and_cut_padding():
    rng = random.Random(0)
    lengths = [rng.randint(8, 14) if rng.random() < 0.875 else rng.randint(40, 64) for _ in range(128)]
    groups = length_buckets(lengths)
    assert sorted(i for g in groups for i in g) == list(range(128))
    cost = sum(len(g) * max(lengths[i] for i in g) + CALL_COST_TOKENS for g in groups)
    assert cost < 0.5 * (128 * max(lengths) + CALL_COST_TOKENS)  # padded to the longest: over twice the work
    assert length_buckets([10] * 50) == [list(range(50))]  # nothing to gain: one call


def test_bucketed_logprobs_equal_one_padded_forward():
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_model(tok, hidden_size=32, layers=2, heads=2).eval()
    rng = random.Random(1)
    trajs = []
    for i in range(40):
        n = rng.randint(6, 10) if i % 8 else rng.randint(30, 60)
        ids = [rng.randrange(3, len(tok)) for _ in range(n)]
        trajs.append(
            Trajectory(str(i), "g", "t", 0, ids, [0] * 3 + [1] * (n - 3), [0.0] * n, [-1] * 3 + [0] * (n - 3))
        )
    batch = collate(trajs, tok.pad_token_id, 0)
    with torch.no_grad():
        logp, entropy = token_logprobs(model, batch, temperature=0.7)
        logits = model(input_ids=batch["tokens"], attention_mask=batch["attention"]).logits[:, :-1].float()
        full = torch.log_softmax(logits / 0.7, -1)
    counted = batch["mask"] > 0
    assert logp.shape == batch["mask"].shape
    assert torch.allclose(
        logp[counted], full.gather(-1, batch["targets"][..., None]).squeeze(-1)[counted], atol=1e-5
    )
    assert torch.allclose(entropy[counted], -(full.exp() * full).sum(-1)[counted], atol=1e-5)


def test_thread_plan_picks_the_split_the_rates_favour():
    # generation barely speeds up with threads, training does: give training the cores
    rates = {1: {"generate": 0.5, "train": 1.2}, 2: {"generate": 0.45, "train": 0.7},
             3: {"generate": 0.44, "train": 0.5}, 4: {"generate": 0.44, "train": 0.4}}
    plan = choose(rates, 4, overlap=True)
    assert (plan["inference"], plan["trainer"]) == (1, 3) and plan["plan"] == "1/3"
    assert plan["predicted_step_seconds"]["1/3"] == 0.5 and plan["overlap_pays"]


def test_alternating_roles_each_take_their_fastest_count():
    # the tiny model: decoding slower on two threads, training faster (measured on this machine)
    rates = {1: {"generate": 0.1, "train": 0.33}, 2: {"generate": 0.36, "train": 0.19}}
    plan = choose(rates, 2, overlap=False)
    assert (plan["inference"], plan["trainer"], plan["plan"]) == (1, 2, ALTERNATE)
    assert plan["predicted_step_seconds"][ALTERNATE] == pytest.approx(0.29)
    assert not plan["overlap_pays"]  # split 1/1 would take 0.33 s a step
    long_answers = {1: {"generate": 0.40, "train": 0.6}, 2: {"generate": 0.22, "train": 0.36}}
    assert (
        choose(long_answers, 2, overlap=False)["inference"],
        choose(long_answers, 2, overlap=True)["inference"],
    ) == (2, 1)
    balanced = {1: {"generate": 0.3, "train": 0.3}, 2: {"generate": 0.25, "train": 0.2}}
    assert choose(balanced, 2, overlap=True)["overlap_pays"]


def test_profile_stacks_each_role_to_its_uptime_and_counts_framework_time():
    record = {
        "time/trainer/wait_batch": 1.5, "time/trainer/forward_backward": 6.5, "time/trainer/optimizer": 1.0,
        "time/trainer/publish": 0.5, "time/trainer/read_batch": 0.2, "time/trainer/uptime": 10.0,
        "time/inference/generate": 7.0, "time/inference/load_weights": 0.3, "time/inference/respond": 0.2,
        "time/inference/uptime": 10.5, "time/orchestrator/ledger": 0.4, "time/orchestrator/cpu": 1.0,
        "time/orchestrator/uptime": 9.0, "time/verifiers/score": 0.1,
    }
    roles = profile(record)
    assert roles["trainer"]["other"] == pytest.approx(0.3) and sum(
        roles["trainer"].values()
    ) == pytest.approx(10.0)
    assert roles["inference"]["idle"] == pytest.approx(3.0)
    assert roles["orchestrator"] == pytest.approx(
        {"ledger": 0.4, "http_and_bookkeeping": 0.6, "off_cpu": 8.0}
    )
    summary = profile_summary(roles)
    framework = 0.5 + 0.2 + 0.3 + 0.3 + 0.2 + 1.0  # publish, read, other; load, respond; orchestrator CPU
    assert summary["framework_seconds"] == pytest.approx(framework, abs=0.05)
    assert summary["framework_overhead_fraction"] == pytest.approx(framework / 20, abs=1e-3)
    assert summary["bound_by"] == "trainer" and summary["generation_seconds"] == 7.0


def test_batched_scoring_fails_only_the_item_that_hangs_or_raises(tests_on_path):
    async def go():
        pool = VerifierPool(TaskConfig(verifier="faulty:by_word"), workers=1)
        try:
            items = [(word, {"answer": "x"}) for word in ("a", "hang", "burn", "raise", "c")]
            return await pool.score_many(items, timeout=1.0), pool.cpu_seconds
        finally:
            pool.close()

    results, cpu = asyncio.run(go())
    assert results[0] == results[2] == results[4] == 1.0
    assert isinstance(results[1], VerifierError) and "took over 1s" in str(results[1])
    assert isinstance(results[3], VerifierError) and "ValueError: asked to" in str(results[3])
    # the verifiers' own CPU time: burn's 0.05 s and microseconds for the rest; the hung one is not counted
    assert 0.05 <= cpu < 0.5, cpu


def test_verifier_workers_do_not_import_the_orchestrator_again():
    """multiprocessing's fork server prepares each worker it forks by importing the parent's main module
    again, unless that is a package's __main__: the orchestrator role runs as one, so that its verifier
    workers start without its imports (they held the first batch's scores back by seconds)."""
    from asyncrl.run.processes import MODULES

    def imported_by_a_worker(main_module: str) -> list[str]:
        code = ("import sys, multiprocessing.spawn as spawn; "
                f"spawn.prepare({{'init_main_from_name': {main_module!r}}}); "
                "print('asyncrl.orchestrator.rollout' in sys.modules, 'aiohttp' in sys.modules)")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    assert MODULES["orchestrator"] == "asyncrl.orchestrator"  # run as -m: __main__'s name is .__main__
    assert imported_by_a_worker("asyncrl.orchestrator.__main__") == ["False", "False"]
    assert imported_by_a_worker("asyncrl.orchestrator.main") == ["True", "True"]  # (as it was)
