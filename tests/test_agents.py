"""Agents against a real inference server process: token-faithful multi-turn records, the
OpenAI proxy driven by the official `openai` client, tools that fail, agents that fail."""
import asyncio
import json
from pathlib import Path

import agents_for_tests as helpers
import pytest
from agents_for_tests import agent_runner, sampled_spans
from conftest import inference_server, job_config

from asyncrl.agents.chat import Renderer, conversation_segments, normalize
from asyncrl.agents.runner import EpisodeQueue
from asyncrl.observe.events import read_events
from asyncrl.orchestrator.rollout import rollout_agent_group
from asyncrl.rundir import RunDir


@pytest.fixture(scope="module")
def server(calc_model, tmp_path_factory):
    with inference_server(tmp_path_factory.mktemp("agents"), calc_model) as (url, run_dir):
        yield url, run_dir, calc_model


def run(coro):
    return asyncio.run(coro)


def test_openai_client_multi_turn_record_is_exact_and_never_re_encoded(server, record):
    """An OpenAI-client agent's three turns are recorded as the engine's ids, never re-encoded.

    Measured (10 runs, two at a time): 5 tool turns every time (seeded sampling: deterministic)."""
    encoded: list[list[int]] = []

    async def go():
        async with agent_runner(server, "openai_agent") as (runner, _, _):
            original = runner.renderer.encode
            runner.renderer.encode = lambda text: encoded.append(original(text)) or encoded[-1]
            return [await runner.episode({"prompt": f"{12 + i}*{34 + i}", "answer": "0"}, f"{i}-0",
                                         runner.server, i)
                    for i in range(16)], runner.renderer

    outcomes, renderer = run(go())
    tok = renderer.tokenizer
    tool_turns = 0
    for out in outcomes:
        ep = out.episode
        eid = next(k for k in helpers.CONVERSATIONS if k.startswith(f"{outcomes.index(out)}-0-"))
        messages = [normalize(m) for m in helpers.CONVERSATIONS[eid]]
        assert out.failure is None and out.reward in (0.5, 1.0) and ep.turns == 3
        # the policy's tokens are exactly the ids the engine returned, turn by turn, with their
        # logprobs and versions
        assert sampled_spans(ep) == helpers.RETURNED_IDS[eid]
        assert all((m == 1) == (v >= 0) for m, v in zip(ep.loss_mask, ep.versions))
        assert all(lp == 0.0 for m, lp in zip(ep.loss_mask, ep.logprobs) if not m)
        # decoded, the record is the conversation as the chat template renders it (up to the last
        # reply's glue)
        rendered = renderer.text(messages[:-1], None, False)
        text = tok.decode(ep.tokens)
        assert rendered.startswith(text) and rendered[len(text):] in ("\n", "<eos>\n")
        tool_turns += sum(1 for m in messages if m["role"] == "tool")
    record("tool_turns", tool_turns, threshold=0)
    assert tool_turns > 0, "no episode called the calculator; the test could not check tool turns"
    # nothing the policy sampled was ever encoded: every encoded token is context (mask 0)
    assert sum(len(e) for e in encoded) == sum(
        len(o.episode.tokens) - o.episode.sampled_tokens for o in outcomes
    )


def test_tool_that_raises_or_times_out_gives_the_agent_an_error_and_an_event(server):
    async def go():
        async with agent_runner(server, "tool_error_agent", **{"agent.max_episode_tokens": 250}) as (
            runner,
            _,
            run_dir,
        ):
            return await runner.episode({"prompt": "1+2", "answer": "3"}, "t-0", runner.server, 0), run_dir

    out, run_dir = run(go())
    assert out.failure is None, out.error
    eid = next(k for k in helpers.CONVERSATIONS if k.startswith("t-0-"))
    results = [m["content"] for m in helpers.CONVERSATIONS[eid] if m["role"] == "tool"]
    assert results[0] == "error: tool 'broken' failed: RuntimeError: the tool broke"
    assert results[1] == "error: tool 'slow' timed out after 0.2s"
    assert results[2] == "error: no tool named 'missing'; tools: add, broken, slow"
    assert out.reward == 0.25 and out.episode.turns == 2 and not out.episode.truncated
    assert sorted(c["name"] for c in out.episode.tool_calls) == [
        "broken",
        "missing",
        "slow",
    ]  # run concurrently
    events = [e for e in read_events(run_dir) if e["event"] == "tool_error" and e["episode"] == eid]
    assert {e["tool"] for e in events} == {"broken", "slow", "missing"}
    bad = run(helpers.add.run("not json"))  # the policy wrote arguments that do not parse
    assert bad.error and bad.text.startswith(
        "error: tool 'add' failed: ValueError: arguments are not valid JSON"
    )
    assert run(helpers.add.run({"expression": "2+3"})).text == "5"
    assert helpers.add.schema["function"]["parameters"] == {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}


def test_two_calls_at_once_on_one_episode_are_taken_in_turn(server):
    """Deterministic: the second call waits for the first, then is refused (its messages do not hold
    the first call's reply); the record is one prompt and one reply, never two interleaved."""
    from transformers import AutoTokenizer

    from asyncrl.agents.chat import ChatFormatError, PolicySession
    from asyncrl.agents.episode import Episode, Limits
    from asyncrl.inference.client import InferenceClient

    url, _, model = server
    tok = AutoTokenizer.from_pretrained(model)

    async def go():
        async with InferenceClient(url, 30) as client:
            session = PolicySession(Episode(Limits(8, 200, 8)), client, Renderer(tok),
                                    {"temperature": 1.0, "top_p": 1.0}, [tok.eos_token_id])
            messages = [{"role": "user", "content": "12*34"}]
            calls = [session.chat(messages), session.chat(messages)]
            return await asyncio.gather(*calls, return_exceptions=True), session.episode

    (first, second), episode = run(go())
    assert isinstance(first, tuple) and isinstance(second, ChatFormatError), (first, second)
    assert "already holds 2" in str(second)
    assert episode.turns == 1
    masks = episode.loss_mask
    assert masks == sorted(masks) and 0 in masks and 1 in masks  # context, then the one reply


def test_a_failing_agent_fails_only_its_episode(server):
    async def go():
        async with agent_runner(
            server, "flaky_agent", **{"timeouts.episode": 3.0, "agent.max_turns": 4, "rollout.group_size": 5}
        ) as (runner, cfg, run_dir):
            task = {"prompt": "12+30=", "answer": "42"}
            return await rollout_agent_group(runner, runner.server, task, 7, cfg), run_dir

    (scored, dropped), run_dir = run(go())
    reasons = {d["id"]: d["reason"] for d in dropped}
    assert reasons == {"7-1": "agent_error", "7-2": "episode_timeout"}
    assert "agent bug" in next(d["error"] for d in dropped if d["id"] == "7-1")
    by_id = {t.id: t for t in scored}
    assert set(by_id) == {"7-0", "7-3", "7-4"}
    truncated = by_id["7-3"]  # ran into agent.max_turns: kept, with the rewards it earned (none)
    assert (
        truncated.info["turns"] == 4
        and "turn limit" in truncated.info["truncated"]
        and truncated.reward == 0.0
    )
    assert by_id["7-0"].reward in (0.0, 1.0) and by_id["7-0"].info["turns"] == 1
    failed = [e for e in read_events(run_dir) if e["event"] == "episode_failed"]
    assert {e["reason"] for e in failed} >= {"agent_error", "episode_timeout"}


def test_completions_endpoint_extends_the_episode_text(server):
    async def go():
        async with agent_runner(server, "completions_agent") as (runner, _, _):
            return await runner.episode(
                {"prompt": "12+30=", "answer": "42"}, "c-0", runner.server, 0
            ), runner.renderer.tokenizer

    out, tok = run(go())
    ep = out.episode
    assert out.failure is None and ep.turns == 2 and len(sampled_spans(ep)) == 2
    assert tok.decode(ep.tokens[:7]) == "<bos>12+30="


def test_history_edits_and_bad_requests_are_refused_with_a_reason(server):
    import openai

    errors: list[str] = []

    async def editing_agent(task, ctx):
        client = ctx.openai()
        messages = [{"role": "user", "content": "1*2"}]
        first = await client.chat.completions.create(model="p", messages=messages)
        messages += [first.choices[0].message, {"role": "user", "content": "again"}]
        edited = [{"role": "user", "content": "edited"}, *messages[1:]]
        for bad in (lambda: client.chat.completions.create(model="p", messages=edited),
                    lambda: client.chat.completions.create(model="p", messages=messages, n=2),
                    lambda: client.completions.create(model="p", prompt="x")):
            try:
                await bad()
            except openai.BadRequestError as e:
                errors.append(str(e))
        second = await client.chat.completions.create(model="p", messages=messages)  # the episode goes on
        return 1.0 if second.choices else 0.0

    async def go():
        async with agent_runner(server, "openai_agent") as (runner, _, _):
            runner.agent_of[None] = editing_agent
            return await runner.episode({"prompt": "", "answer": ""}, "e-0", runner.server, 0)

    out = run(go())
    assert len(errors) == 3
    assert "message 0 (user) differs from the one this episode already holds" in errors[0]
    assert "n must be 1" in errors[1]
    assert "this episode is a chat" in errors[2]
    assert out.failure is None and out.reward == 1.0 and out.episode.turns == 2


def test_environment_turn_rewards_add_up(server):
    async def go():
        async with agent_runner(server, "Countdown") as (runner, _, _):
            outcome = await runner.episode({"prompt": "go", "answer": ""}, "env-0", runner.server, 0)
            return outcome, runner.renderer.tokenizer

    out, tok = run(go())
    assert out.failure is None and out.episode.turns == 3
    assert out.episode.turn_rewards == [0.1, 0.1, 0.1] and out.reward == pytest.approx(0.3)
    assert "U:2 left\nA:" in tok.decode(out.episode.tokens)


def test_conversation_segments_mark_only_the_replies(calc_model):
    from transformers import AutoTokenizer

    renderer = Renderer(AutoTokenizer.from_pretrained(calc_model))
    call = {"type": "function", "function": {"name": "calc", "arguments": {"expression": "2*3"}}}
    messages = [
        {"role": "user", "content": "2*3"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "6"},
        {"role": "assistant", "content": "6"},
    ]
    segments = conversation_segments(renderer, messages)
    assert "".join(t for t, _ in segments) == renderer.text(messages, None, False)
    assert [t for t, policy in segments if policy] == ["calc(2*3)<eos>", "6<eos>"]


def test_episode_queue_limits_concurrency_and_batches_in_waves():
    """Deterministic: episode 0 is a straggler that runs until released; the others finish at once."""
    async def measure(mode: str) -> tuple[int, list[int], list[tuple[str, int]]]:
        queue, running, peak, log = EpisodeQueue(3, mode), 0, 0, []
        release = asyncio.Event()

        async def episode(i: int):
            nonlocal running, peak
            async with queue.slot(i):
                log.append(("start", i))
                running += 1
                peak = max(peak, running)
                await (release.wait() if i == 0 else asyncio.sleep(0))
                running -= 1
                log.append(("end", i))

        tasks = [asyncio.create_task(episode(i)) for i in range(9)]
        seen = -1
        while seen != len(log):  # let every episode that can run, run, while the straggler holds its slot
            seen = len(log)
            for _ in range(20):
                await asyncio.sleep(0)
        started_meanwhile = sorted(i for event, i in log if event == "start")
        release.set()
        await asyncio.gather(*tasks)
        return peak, started_meanwhile, log

    peak, meanwhile, _ = run(measure("queue"))
    assert peak == 3 and meanwhile == list(range(9))  # the straggler's wave-mates' slots went on to 3..8
    peak, meanwhile, log = run(measure("batch"))
    assert peak == 3 and meanwhile == [0, 1, 2]  # the next wave waits for the straggler
    assert log.index(("start", 3)) > log.index(("end", 0))
    assert [i for event, i in log if event == "start"] == list(range(9))


EXAMPLES = Path(__file__).parents[1] / "examples" / "agents"


@pytest.mark.e2e
def test_multi_task_agent_run_end_to_end(calc_model, tmp_path, record):
    """A real run (three processes) mixing the OpenAI-client calculator agent (through the proxy) and
    the guessing Environment, with per-task advantage normalisation and per-task metrics.

    Measured (two sets of 10 runs, two at a time): 20 ± 2.2 calculator tool calls (min 17), then
    17.8 ± 3.2 (min 13), against a bound of 0: at least 5.5 standard deviations."""
    from asyncrl.run.launcher import train
    from asyncrl.store.ledger import audit
    from asyncrl.trajectory import read_batch

    mix = [{"name": "products", "label": "calc", "params": {"min_terms": 2, "max_terms": 2, "min_digits": 2,
                                                              "max_digits": 3},
            "verifier": f"{EXAMPLES}/calculator.py:exact", "agent": f"{EXAMPLES}/calculator.py:agent"},
           {"name": f"{EXAMPLES}/guess.py:tasks", "label": "guess", "agent": f"{EXAMPLES}/guess.py:Guess",
            "holdout": 0}]
    cfg = job_config(tmp_path, calc_model, **{
        "run.steps": 6, "task.eval_size": 16, "task.eval_every": 3, "agent.tool_parser": "compact",
        "agent.max_turns": 4, "agent.max_episode_tokens": 80, "rollout.max_tokens": 16,
        "rollout.task_normalization": True})
    cfg.task.mix = mix
    run_dir = train(cfg, log=lambda *a, **k: None)
    assert audit(run_dir, cfg.rollout.max_staleness)["problems"] == []
    trajs = [t for step in range(cfg.run.steps) for t in read_batch(RunDir(run_dir).batch(step))]
    assert {t.task for t in trajs} == {"calc", "guess"}
    for t in trajs:  # the record's invariants hold in what the trainer read
        assert len(t.tokens) == len(t.loss_mask) == len(t.logprobs) == len(t.versions) <= 80
        assert all((m == 1) == (v >= 0) for m, v in zip(t.loss_mask, t.versions))
    calls = sum(t.info["tool_calls"] for t in trajs if t.task == "calc")
    record("calc_tool_calls", calls, threshold=0)
    assert calls > 0
    assert max(t.info["turns"] for t in trajs if t.task == "guess") > 1
    for step in range(cfg.run.steps):  # per task and batch, token advantages have mean 0
        batch = read_batch(RunDir(run_dir).batch(step))
        for task in {t.task for t in batch}:
            values = [a for t in batch if t.task == task for a, m in zip(t.advantages, t.loss_mask) if m]
            assert abs(sum(values) / len(values)) < 1e-4
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step" in r]
    assert all("turns_mean" in r and "tool_calls_mean" in r for r in steps)
    assert any("reward/calc" in r and "reward/guess" in r for r in steps)
    evals = [r for r in records if "eval_accuracy" in r]
    assert [r["eval_version"] for r in evals] == [0, 3, 6]
    assert all("eval_accuracy/calc" in r and "eval_accuracy/guess" in r for r in evals)
