"""The engine's tokens and logprobs against plain full-sequence forward passes."""
import torch

from asyncrl.inference.engine import Engine, SamplingParams, Sequence, sample_rows
from asyncrl.policy.model import build_char_tokenizer, build_tiny_model

TOK = build_char_tokenizer()


def engine(seed=0, **kw):
    torch.manual_seed(0)
    return Engine(
        build_tiny_model(TOK, hidden_size=32, layers=2, heads=2),
        TOK.pad_token_id,
        TOK.eos_token_id,
        seed,
        **kw,
    )


def full_logprobs(model, prompt, completion, temperature=1.0):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float() / temperature, -1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion)]


PROMPTS = [TOK(p)["input_ids"] for p in ["84-12=", "1+2=", "99+99=", "7-70="]]


def test_logprobs_match_a_full_forward_pass():
    e = engine()
    for params in (
        SamplingParams(max_tokens=6, temperature=1.0),
        SamplingParams(max_tokens=6, temperature=0.7),
    ):
        for prompt, sample in zip(PROMPTS, e.generate(PROMPTS, params)):
            expected = full_logprobs(e.model, prompt, sample.token_ids, params.temperature)
            assert torch.allclose(torch.tensor(sample.logprobs), torch.tensor(expected), atol=1e-4)
            assert sample.versions == [0] * len(sample.token_ids)


def test_batched_greedy_equals_one_at_a_time():
    e = engine()
    params = SamplingParams(max_tokens=6, temperature=0)
    together = e.generate(PROMPTS, params)
    alone = [e.generate([p], params)[0] for p in PROMPTS]
    assert [s.token_ids for s in together] == [s.token_ids for s in alone]


def test_stop_tokens_end_a_sample_and_are_kept():
    e = engine()
    first = e.generate([PROMPTS[0]], SamplingParams(max_tokens=5, temperature=0))[0]
    stop = first.token_ids[2]
    sample = e.generate([PROMPTS[0]], SamplingParams(max_tokens=5, temperature=0, stop_token_ids=(stop,)))[0]
    assert sample.finish_reason == "stop"
    assert sample.token_ids == first.token_ids[: first.token_ids.index(stop) + 1]


def test_top_p_and_temperature_per_row():
    gen = torch.Generator().manual_seed(3)
    logits = torch.tensor([[3.0, 2.9, -5.0, -5.0]] * 2)
    seen = [set(), set()]
    for _ in range(60):
        tokens, _ = sample_rows(logits, torch.tensor([1.0, 0.0]), torch.tensor([0.5, 1.0]), gen)
        seen[0].add(int(tokens[0]))
        seen[1].add(int(tokens[1]))
    assert seen[0] == {0}  # the nucleus of 0.5 holds only the top token
    assert seen[1] == {0}  # greedy row


def test_draws_follow_the_distribution_across_blocks_and_never_pick_an_impossible_token():
    """The blocked inverse-CDF draw (asyncrl/inference/sampling.py) against the softmax: 300,000 draws over a
    vocabulary of 1,000 (four blocks, the last one short) with masked tokens at block edges. Each
    frequency's standard error is at most 0.0009; the bound is 5 of them."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 2
    impossible = [0, 255, 256, 511, 999]
    base[impossible] = -torch.inf
    n = 300_000
    tokens, logprobs = sample_rows(base.repeat(n, 1), torch.ones(n), torch.ones(n), gen)
    freq = torch.bincount(tokens, minlength=1000).double() / n
    expected = torch.softmax(base, -1).double()
    assert (freq - expected).abs().max() < 5 * 0.0009
    assert freq[impossible].sum() == 0
    assert torch.allclose(logprobs, torch.log_softmax(base, -1)[tokens])


def test_version_tags_follow_loaded_weights():
    e = engine()
    state = {k: v + 0.01 for k, v in e.model.state_dict().items()}
    e.reload(state, version=7)
    sample = e.generate([PROMPTS[0]], SamplingParams(max_tokens=3))[0]
    assert sample.versions == [7] * len(sample.token_ids)


def test_requests_joining_mid_generation_match_one_at_a_time():
    """Continuous batching: rows join and leave at token boundaries; greedy tokens and logprobs
    equal those of each prompt generated alone."""
    e = engine()
    params = [SamplingParams(max_tokens=n, temperature=0) for n in (9, 3, 6, 12)]
    alone = [e.generate([p], q)[0] for p, q in zip(PROMPTS, params)]
    seqs = [Sequence(p, q) for p, q in zip(PROMPTS, params)]
    e.add(seqs[:2])
    e.step()
    e.step()
    e.add(seqs[2:3])  # joins a running batch whose rows are already 2 tokens in
    e.step()
    e.add(seqs[3:])
    while e.has_work():
        e.step()
    for seq, ref in zip(seqs, alone):
        assert seq.sample.token_ids == ref.token_ids
        assert torch.allclose(torch.tensor(seq.sample.logprobs), torch.tensor(ref.logprobs), atol=1e-5)


def test_samples_of_one_prompt_share_its_prefill():
    e = engine()
    samples = e.generate([PROMPTS[0]] * 5, SamplingParams(max_tokens=6, temperature=0))
    assert len({tuple(s.token_ids) for s in samples}) == 1


def test_back_pressure_bounds_the_running_batch():
    e = engine(max_sequences=2)
    seqs = [Sequence(p, SamplingParams(max_tokens=4, temperature=1.0)) for p in PROMPTS + PROMPTS]
    e.add(seqs)
    peak = 0
    while e.has_work():
        e.step()
        peak = max(peak, len(e.running))
    assert peak == 2 and all(s.sample.finish_reason for s in seqs)


def _perturbed(model, seed):
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}


def _update_after_three_tokens(policy: str):
    """(engine, old weights, new weights, sample) of one sequence given version 1 after 3 tokens."""
    e = engine()
    old = {k: v.clone() for k, v in e.model.state_dict().items()}
    new = _perturbed(e.model, 1)
    seq = Sequence(PROMPTS[0], SamplingParams(max_tokens=8, temperature=1.0))
    e.add([seq])
    for _ in range(3):
        e.step()
    e.reload(new, version=1, policy=policy)
    while e.has_work():
        e.step()
    return e, old, new, seq.sample


def test_interrupted_update_switches_versions_at_the_boundary():
    """Partial rollout: tokens before the update carry version 0 and its logprobs, tokens after
    carry version 1 and exactly version 1's logprobs given the whole prefix."""
    e, old, new, s = _update_after_three_tokens("interrupt")
    assert s.versions == [0, 0, 0] + [1] * (len(s.token_ids) - 3)
    e.model.load_state_dict(old)
    before = full_logprobs(e.model, PROMPTS[0], s.token_ids)[:3]
    e.model.load_state_dict(new)
    after = full_logprobs(e.model, PROMPTS[0], s.token_ids)[3:]
    assert torch.allclose(torch.tensor(s.logprobs), torch.tensor(before + after), atol=1e-4)


def test_keep_policy_goes_on_with_the_old_cache_and_records_the_true_logprobs():
    """In-flight update without recompute: the token sampled from logits computed before the
    update keeps version 0; later ones carry version 1 and the logprobs of the new weights
    attending to the cache the old weights wrote (what was sampled from, exactly)."""
    from transformers import DynamicCache

    e, old, new, s = _update_after_three_tokens("keep")
    assert len(s.token_ids) > 5 and e.tokens_discarded == 0
    assert s.versions == [0, 0, 0, 0] + [1] * (len(s.token_ids) - 4)
    e.model.load_state_dict(old)
    assert torch.allclose(
        torch.tensor(s.logprobs[:4]),
        torch.tensor(full_logprobs(e.model, PROMPTS[0], s.token_ids)[:4]),
        atol=1e-4,
    )
    with torch.no_grad():
        cache = e.model(torch.tensor([PROMPTS[0] + s.token_ids[:3]]), **{e.cache_arg: DynamicCache()},
                        use_cache=True)[e.cache_arg]
        e.model.load_state_dict(new)
        logits = e.model(torch.tensor([s.token_ids[3:-1]]), **{e.cache_arg: cache}).logits[0]
    mixed = (
        torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(s.token_ids[4:])[:, None]).squeeze(-1)
    )
    assert torch.allclose(torch.tensor(s.logprobs[4:]), mixed, atol=1e-4)
    fresh = full_logprobs(e.model, PROMPTS[0], s.token_ids)[4:]
    assert not torch.allclose(torch.tensor(s.logprobs[4:]), torch.tensor(fresh), atol=1e-4)


def test_abort_policy_regenerates_under_the_new_version():
    e = engine()
    seq = Sequence(PROMPTS[1], SamplingParams(max_tokens=8, temperature=1.0))
    e.add([seq])
    e.step()
    e.step()
    e.reload(_perturbed(e.model, 2), version=1, policy="abort")
    while e.has_work():
        e.step()
    assert set(seq.sample.versions) == {1} and e.tokens_discarded == 2
    assert torch.allclose(
        torch.tensor(seq.sample.logprobs),
        torch.tensor(full_logprobs(e.model, PROMPTS[1], seq.sample.token_ids)),
        atol=1e-4,
    )


def test_abort_all_returns_partial_samples():
    e = engine()
    seqs = [Sequence(p, SamplingParams(max_tokens=20, temperature=1.0)) for p in PROMPTS]
    e.add(seqs)
    e.step()
    assert e.abort_all() == 4
    assert all(s.sample.finish_reason in ("abort", "stop") for s in seqs) and not e.has_work()


def test_cancelled_sequences_free_their_rows_and_the_rest_match_an_undisturbed_run():
    """A request abandoned mid-generation (its client went away) stops generating: its running rows and
    waiting entries go, and the other requests' samples are what they would have been."""
    params = SamplingParams(max_tokens=12, temperature=0.0)
    alone = engine().generate(PROMPTS[:2], params)
    e = engine(max_sequences=3)
    kept = [Sequence(p, params) for p in PROMPTS[:2]]
    abandoned = [Sequence(p, params) for p in PROMPTS[2:] * 2]  # one runs, three wait
    e.add(kept + abandoned)
    e.step()
    e.step()
    assert len(e.running) == 3 and len(e.waiting) == 3
    assert e.cancel(abandoned) == 4
    assert len(e.running) == 2 and not e.waiting
    while any(s.sample.finish_reason is None for s in kept):
        e.step()
    assert [s.sample.token_ids for s in kept] == [s.token_ids for s in alone]
    assert all(s.sample.finish_reason is None for s in abandoned) and not e.has_work()


def test_a_turn_that_continues_a_cached_one_prefills_only_its_new_tokens():
    """Three agent episodes of three turns each, all running together: a turn's request is the episode so
    far plus what the environment said. With the prefix cache the engine feeds only the new tokens; the
    samples are those of an engine without it (greedy, and the logprobs of a full forward pass)."""
    results = {}
    for budget in (0, 4096):
        e = engine(prefix_cache_tokens=budget)
        params = SamplingParams(max_tokens=5, temperature=0.0, cache_prefix=True)
        episodes = [list(p) for p in PROMPTS[:3]]
        for turn in range(3):
            samples = e.generate(episodes, params)
            for episode, sample in zip(episodes, samples):
                expected = full_logprobs(e.model, episode, sample.token_ids)
                assert torch.allclose(torch.tensor(sample.logprobs), torch.tensor(expected), atol=1e-4)
                episode += sample.token_ids + TOK(f"={turn}?")["input_ids"]  # the environment's reply
        results[budget] = episodes, e.tokens_prefilled, e.tokens_reused
    (plain, plain_fed, none_reused), (cached, cached_fed, reused) = results[0], results[4096]
    assert cached == plain and none_reused == 0
    assert reused > 0 and cached_fed + reused == plain_fed  # every token fed once, or found cached
    assert cached_fed < plain_fed / 2


def test_the_prefix_cache_keeps_to_its_budget_and_forgets_on_new_weights():
    e = engine(prefix_cache_tokens=24)
    params = SamplingParams(max_tokens=6, temperature=0.0, cache_prefix=True)
    first = e.generate(PROMPTS, params)
    assert 0 < e.prefixes.tokens <= 24 and len(e.prefixes.entries) < len(PROMPTS)  # the oldest went out
    newest = PROMPTS[-1] + first[-1].token_ids
    e.generate([newest + TOK("?")["input_ids"]], params)
    assert e.tokens_reused == len(newest) - 1  # (the last sampled token had not been fed)
    assert e.prefixes.entries  # (the continued turn is cached in its turn)
    e.reload(None, version=1, policy="interrupt")
    assert e.prefixes.tokens == 0 and not e.prefixes.entries
