"""Token faithfulness on the byte-level BPE tokenizer: the trainer sees exactly the ids the engine
sampled, in single completions and across agent turns, never a re-encoding of their text.

A randomly initialised policy samples token sequences that BPE would never produce from their text
(two tokens where a merge exists, half a UTF-8 character, a reply cut before its end token), so
every test here would fail for a pipeline that decodes and encodes again; each test also checks
that such a sequence did occur, so none passes vacuously.
"""
import asyncio

import agents_for_tests as helpers
import pytest
from agents_for_tests import agent_runner, sampled_spans
from conftest import inference_server, job_config

from asyncrl.agents.chat import PolicySession, Renderer
from asyncrl.agents.episode import Episode, Limits
from asyncrl.agents.tool_calls import parse_hermes
from asyncrl.orchestrator.rollout import score_group
from asyncrl.policy.model import IM_END, build_bpe_tokenizer, build_tiny_model, chatml_corpus
from asyncrl.rewards.pool import VerifierPool
from asyncrl.rewards.tasks import load_tasks

CORPUS = [
    "State the final answer to the following arithmetic problem: 84 - 12 = 72",
    'The calculator says <tool_call>\n{"name": "calc", "arguments": {"expression": "12*34"}}\n</tool_call>',
    "Reply with only your guess; after each wrong guess I reply higher or lower.",
    "héllo wörld, naïve café — 🙂 emoji and tabs\tand\nnewlines",
] * 20


@pytest.fixture(scope="module")
def bpe_policy(tmp_path_factory) -> str:
    """A random tiny Qwen3 (GQA) with a BPE tokenizer trained on chat, tool-call and task text."""
    out = tmp_path_factory.mktemp("bpe") / "policy"
    tok = build_bpe_tokenizer(chatml_corpus(CORPUS), vocab_size=600)
    build_tiny_model(
        tok, hidden_size=32, layers=2, heads=2, architecture="qwen3", kv_heads=1
    ).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def bpe_server(bpe_policy, tmp_path_factory):
    with inference_server(tmp_path_factory.mktemp("bpe-srv"), bpe_policy) as (url, run_dir):
        yield url, run_dir, bpe_policy


def canonical(tok, ids: list[int]) -> bool:
    """Whether BPE would encode the text of `ids` as `ids` again."""
    return tok(tok.decode(ids), add_special_tokens=False)["input_ids"] == ids


def test_the_tokenizer_is_byte_level_bpe_with_chatml(bpe_policy):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bpe_policy)
    words = tok(" arithmetic problem", add_special_tokens=False)["input_ids"]
    assert len(words) == 2 and tok.decode(words) == " arithmetic problem"  # multi-character merges
    assert tok.convert_ids_to_tokens(tok("assistant", add_special_tokens=False)["input_ids"]) == ["assistant"]
    assert len(tok("12345", add_special_tokens=False)["input_ids"]) == 5  # digits never merge (as in Qwen)
    assert tok.convert_tokens_to_ids(IM_END) == tok.eos_token_id and tok.pad_token == "<|endoftext|>"
    assert tok(f"a{IM_END}b", add_special_tokens=False)["input_ids"][1] == tok.eos_token_id  # one special id
    for text in ("héllo 🙂\tx\n", "字节级 BPE", "\x00\x7f"):  # every byte string round-trips
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    call = {"type": "function", "function": {"name": "calc", "arguments": {"expression": "2*3"}}}
    messages = [
        {"role": "user", "content": "2*3"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    rendered = tok.apply_chat_template(messages, tools=[helpers.calc.schema], tokenize=False)
    assert (
        rendered.startswith("<|im_start|>system\n# Tools") and "<|im_start|>user\n2*3<|im_end|>\n" in rendered
    )
    reply = rendered.split("<|im_start|>assistant\n")[-1].removesuffix("<|im_end|>\n")
    _, calls = parse_hermes(reply, [helpers.calc.schema])
    assert [c["function"]["name"] for c in calls] == ["calc"] and '"2*3"' in calls[0]["function"]["arguments"]


def test_a_completion_record_is_the_prompt_ids_and_the_sampled_ids(bpe_server, tmp_path, record):
    """Sampled completions keep the engine's ids, including ones BPE would have written otherwise.

    Measured (10 runs, two at a time): 16 of the sampled completions were non-canonical every time
    (seeded sampling: deterministic), so the check below always has drift to catch."""
    url, _, model = bpe_server
    from transformers import AutoTokenizer

    from asyncrl.inference.client import InferenceClient

    tok = AutoTokenizer.from_pretrained(model)
    cfg = job_config(tmp_path, model, **{"rollout.group_size": 16, "rollout.max_tokens": 12})
    tasks = load_tasks(cfg.task)
    entry = {**tasks.item(0), "prompt": ""}
    prompt = tasks.prompt_ids(entry, tok)
    assert tok.decode(prompt).startswith("<|im_start|>user\n") and tok.decode(prompt).endswith(
        "<|im_start|>assistant\n"
    )

    async def go():
        verifiers = VerifierPool(cfg.task, 1)
        try:
            async with InferenceClient(url, 30) as client:
                await client.wait_healthy(30)
                ro, got = cfg.rollout, {}
                await client.complete_groups([prompt], ro.group_size, ro.max_tokens, ro.temperature, ro.top_p,
                                             got.setdefault)
                return await score_group(verifiers, entry, prompt, 0, got[0], 0.0, cfg)
        finally:
            verifiers.close()

    scored, dropped = asyncio.run(go())
    assert not dropped and len(scored) == 16
    drift = 0
    for t in scored:
        completion = t.tokens[len(prompt):]
        assert t.tokens[: len(prompt)] == prompt and t.loss_mask == [0] * len(prompt) + [1] * len(completion)
        assert len(t.logprobs) == len(t.versions) == len(t.tokens)
        drift += not canonical(tok, completion)
    record("non_canonical_completions", drift, threshold=0)
    assert drift > 0, "every completion was a canonical encoding; the test could not tell re-encoding apart"


def test_agent_turns_keep_the_sampled_ids_across_template_boundaries(bpe_server, record):
    """Three chat turns with a tool result and a user turn between them; replies cut at their token
    budget (no end token) get the template's end glue as context, never merged into the reply.

    Measured (10 runs, two at a time): 31 non-canonical replies and 36 cut replies every time (seeded
    sampling: deterministic), so both checks always have something to catch."""
    url, run_dir, model = bpe_server

    async def go():
        async with agent_runner(
            (url, run_dir, model),
            "bpe_turns_agent",
            **{  # (the tools' system turn is long)
                "agent.tool_parser": "hermes",
                "rollout.max_tokens": 6,
                "agent.max_episode_tokens": 480,
                "inference.max_prompt_tokens": 512,
            },
        ) as (runner, _, _):
            return [await runner.episode({"prompt": f"{12 + i}*{34 + i}", "answer": "0"}, f"{i}-0",
                                         runner.server, i)
                    for i in range(12)], runner.renderer

    outcomes, renderer = asyncio.run(go())
    tok = renderer.tokenizer
    drift = cut = 0
    for i, out in enumerate(outcomes):
        ep = out.episode
        eid = next(k for k in helpers.RETURNED_IDS if k.startswith(f"{i}-0-"))
        assert out.failure is None and ep.turns == 3
        assert sampled_spans(ep) == helpers.RETURNED_IDS[eid]  # exactly the engine's ids, turn by turn
        context = [t for t, m in zip(ep.tokens, ep.loss_mask) if not m]
        glue = "".join(tok.decode([t]) for t in context)
        assert glue.count("<|im_start|>assistant\n") == 3 and "<tool_response>\n" in glue
        for span in helpers.RETURNED_IDS[eid]:
            drift += not canonical(tok, span)
            cut += span[-1] != tok.eos_token_id
    record("non_canonical_replies", drift, threshold=0)
    record("replies_cut_before_their_end", cut, threshold=0)
    assert drift > 0 and cut > 0, (drift, cut)


def test_the_glue_after_a_cut_reply_is_encoded_apart_from_it(bpe_policy):
    """Deterministic: a reply the policy sampled as two tokens that BPE would merge, cut before its end
    token; the next turn adds the template's end glue and the user turn as context ids of their own."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bpe_policy)
    renderer = Renderer(tok)
    merged = tok(" arithmetic", add_special_tokens=False)["input_ids"]
    split = (
        tok(" arith", add_special_tokens=False)["input_ids"]
        + tok("metic", add_special_tokens=False)["input_ids"]
    )
    # `split` is what BPE would never write
    assert len(merged) == 1 and len(split) > 1 and tok.decode(split) == " arithmetic"
    session = PolicySession(Episode(Limits(4, 256, 16)), None, renderer, {"temperature": 1.0, "top_p": 1.0},
                            [tok.eos_token_id])
    first = [{"role": "user", "content": "go"}]
    session.history = first + [{"role": "assistant", "content": " arithmetic"}]
    session.last_sampled = split
    later = session.history + [{"role": "user", "content": "again"}]
    added = session._extension(later, None)
    assert tok.decode(added) == "<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    assert added == tok("<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n",
                        add_special_tokens=False)["input_ids"]


def test_prompts_encode_as_the_chat_template_and_tokenizer_would(bpe_policy):
    """The orchestrator renders a prompt by concatenation with the template's frame and calls the Rust
    encoder directly: the ids must be the template's and the tokenizer's own, and a template that
    changes the content (here: trims it) must not be framed."""
    from transformers import AutoTokenizer

    from asyncrl.rewards.tasks import _chat_frame, encode_prompt

    def reference(tok, text: str, chat: bool) -> list[int]:
        if not chat:
            return tok(text)["input_ids"]
        rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False)
        return tok(rendered, add_special_tokens=False)["input_ids"]

    texts = ["84-12=", "  spaced out \n", "héllo 🙂\t{{ x }}", "", f"a{IM_END}b", "\n\n"]
    tok = AutoTokenizer.from_pretrained(bpe_policy)
    assert _chat_frame(tok) == ("<|im_start|>user\n", f"{IM_END}\n<|im_start|>assistant\n")
    trimming = AutoTokenizer.from_pretrained(bpe_policy)
    trimming.chat_template = trimming.chat_template.replace("{{ m.content }}<|im_end|>",
                                                              "{{ m.content | trim }}<|im_end|>")
    assert trimming.chat_template != tok.chat_template and _chat_frame(trimming) is None
    for t in (tok, trimming):
        for text in texts:
            for chat in (True, False):
                assert encode_prompt(t, text, chat) == reference(t, text, chat), (text, chat)
    assert encode_prompt(trimming, "  x ", True) != encode_prompt(tok, "  x ", True)  # the trim took effect
