"""The engine's tokens and logprobs against plain full-sequence forward passes."""
import torch

from asyncrl.inference.engine import Engine, SamplingParams
from asyncrl.model import build_char_tokenizer, build_tiny_model

TOK = build_char_tokenizer()


def engine(seed=0):
    torch.manual_seed(0)
    return Engine(build_tiny_model(TOK, hidden_size=32, layers=2, heads=2), TOK.pad_token_id, TOK.eos_token_id, seed)


def full_logprobs(model, prompt, completion, temperature=1.0):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float() / temperature, -1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion)]


PROMPTS = [TOK(p)["input_ids"] for p in ["84-12=", "1+2=", "99+99=", "7-70="]]


def test_logprobs_match_a_full_forward_pass():
    e = engine()
    for params in (SamplingParams(max_tokens=6, temperature=1.0), SamplingParams(max_tokens=6, temperature=0.7)):
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


def test_top_p_samples_only_from_the_nucleus():
    e = engine(seed=3)
    logits = torch.tensor([[3.0, 2.9, -5.0, -5.0]])
    from asyncrl.inference.engine import _sample

    seen = {int(_sample(logits, SamplingParams(top_p=0.5), e.generator)[0]) for _ in range(50)}
    assert seen <= {0, 1} and 0 in seen


def test_version_tags_follow_loaded_weights():
    e = engine()
    state = {k: v + 0.01 for k, v in e.model.state_dict().items()}
    e.load_state(state, version=7)
    sample = e.generate([PROMPTS[0]], SamplingParams(max_tokens=3))[0]
    assert sample.versions == [7] * len(sample.token_ids)
