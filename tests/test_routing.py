"""Routing replay (R3) on a tiny Qwen3-MoE: what is recorded is the router's own choice, and a
replayed forward routes by it whatever its own router says (docs/moe.md)."""
import json

import pytest
import torch
from conftest import job_config

from asyncrl.config import load_config
from asyncrl.errors import ConfigError
from asyncrl.inference.engine import Engine, SamplingParams, Sequence
from asyncrl.policy import routing
from asyncrl.policy.model import build_char_tokenizer, build_tiny_model
from asyncrl.run.launcher import train
from asyncrl.run.role import ContractError
from asyncrl.rundir import RunDir
from asyncrl.trainer import logprobs as logprobs_module
from asyncrl.trainer.step import collate
from asyncrl.trajectory import Trajectory, read_batch

TOK = build_char_tokenizer()


def moe(seed=0):
    return build_tiny_model(TOK, hidden_size=32, layers=2, heads=2, seed=seed, architecture="qwen3_moe",
                            experts=8, experts_per_token=2).eval()


def logprobs(model, ids):
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits.float(), -1)
    return lp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]


IDS = torch.tensor([TOK("84-12=72")["input_ids"][:8], TOK("99+99=198")["input_ids"][:8]])


def test_recorded_routing_is_the_routers_own_top_k():
    model = moe()
    with routing.record(routing.routers(model)) as calls, torch.no_grad():
        out = model(IDS, output_router_logits=True)
    assert len(calls) == 1 and len(calls[0]) == 2  # one forward, two MoE layers
    for recorded, logits in zip(calls[0], out.router_logits):
        own = torch.topk(torch.softmax(logits.float(), -1), 2, dim=-1).indices
        assert recorded.shape == (IDS.numel(), 2) and torch.equal(recorded.long(), own)


def test_replay_holds_the_experts_when_the_router_moves():
    """The failure R3 prevents: a small change of the router (another dtype, another kernel) flips
    near-tied experts and moves logprobs; replayed, only the gate weights move, a little."""
    engine, trainer = moe(), moe()
    with routing.record(routing.routers(engine)) as calls:
        reference = logprobs(engine, IDS)
    indices = torch.stack(calls[0])
    torch.manual_seed(1)
    with torch.no_grad():
        for gate in routing.routers(trainer):
            gate.weight.add_(0.005 * torch.randn_like(gate.weight))  # (a third of its scale)
    with routing.record(routing.routers(trainer)) as own:
        drifted = logprobs(trainer, IDS)
    assert not torch.equal(torch.stack(own[0]), indices)  # (the perturbation changed some choices)
    with routing.replay(trainer, indices):
        replayed = logprobs(trainer, IDS)
    without, with_replay = (reference - drifted).abs().max(), (reference - replayed).abs().max()
    assert with_replay < without / 10


def test_replay_with_the_same_router_changes_nothing_and_trains_the_router():
    model = moe()
    with routing.record(routing.routers(model)) as calls:
        reference = logprobs(model, IDS)
    with routing.replay(model, torch.stack(calls[0])):
        out = model(IDS)
    assert torch.allclose(logprobs(model, IDS), reference)
    lp = torch.log_softmax(out.logits.float(), -1)[:, :-1].gather(-1, IDS[:, 1:, None])
    assert torch.allclose(lp[..., 0].detach(), reference, atol=1e-6)
    lp.sum().backward()
    assert all(g.weight.grad is not None and g.weight.grad.abs().sum() > 0 for g in routing.routers(model))


def test_minus_one_keeps_the_routers_choice_and_a_wrong_shape_is_refused():
    model = moe()
    reference = logprobs(model, IDS)
    layers = len(routing.routers(model))
    with routing.replay(model, torch.full((layers, IDS.numel(), 2), -1, dtype=torch.int16)):
        assert torch.allclose(logprobs(model, IDS), reference)
    with pytest.raises(ValueError, match="for 16 tokens"), routing.replay(model, torch.zeros((layers, 3, 2))):
        model(IDS)
    with pytest.raises(ValueError, match="3 MoE layers"), routing.replay(model, torch.zeros((3, 16, 2))):
        pass


def test_the_engine_records_each_fed_tokens_experts_as_a_plain_forward_chooses_them():
    """Continuous batching (rows joining mid-generation, left padding, one prefill row for repeated
    prompts) records for every token fed — the prompt, then each sampled token but the last — the
    experts a plain forward of the whole sequence picks."""
    model = moe()
    engine = Engine(model, TOK.pad_token_id, TOK.eos_token_id, seed=0, prefix_cache_tokens=1000)
    prompts = [TOK(p)["input_ids"] for p in ("84-12=", "1+2=", "84-12=", "99+99=")]
    seqs = [Sequence(p, SamplingParams(max_tokens=n, temperature=1.0)) for p, n in zip(prompts, (7, 3, 5, 9))]
    engine.add(seqs[:3])
    engine.step()
    engine.step()
    engine.add(seqs[3:])  # joins a batch two tokens in
    while engine.has_work():
        engine.step()
    for seq in seqs:
        fed = seq.tokens[:-1]
        routes = routing.stacked(seq.sample.routes)
        with routing.record(routing.routers(model)) as calls, torch.no_grad():
            model(torch.tensor([fed]))
        assert routes.shape == (len(fed), 2, 2)
        assert torch.equal(routes, torch.stack(calls[0]).permute(1, 0, 2))
    assert engine.prefixes.budget == 0  # (a cached prefix has no routes: MoE turns prefill again)


def _engine_samples(model, prompts, n=2):
    engine = Engine(model, TOK.pad_token_id, TOK.eos_token_id, seed=0)
    repeated = [p for p in prompts for _ in range(n)]
    samples = engine.generate(repeated, SamplingParams(max_tokens=6))
    return [Trajectory(f"{i}", str(i // n), "t", i // n, p + s.token_ids,
                       [0] * len(p) + [1] * len(s.token_ids),
                       [0.0] * len(p) + s.logprobs, [-1] * len(p) + s.versions,
                       routing=routing.pack(routing.stacked(s.routes)))
            for i, (p, s) in enumerate(zip(repeated, samples))]


@pytest.mark.parametrize("shared", [False, True], ids=["length_buckets", "shared_prompts"])
def test_the_trainer_replays_the_engines_routing_under_a_perturbed_router(shared, monkeypatch):
    """The trainer's logprobs of the engine's samples: with the router moved, they drift from the
    engine's; replayed, they stay within the gate weights' small change, in both of the trainer's
    forward layouts (each row alone in length buckets; a group's prompt once, its samples after it)."""
    monkeypatch.setattr(logprobs_module, "CALL_COST_TOKENS", 0 if shared else 10**6)
    trajs = _engine_samples(moe(), [TOK(p)["input_ids"] for p in ("84-12=", "1+2=", "99+99=")])
    trainer = moe()
    torch.manual_seed(1)
    with torch.no_grad():
        for gate in routing.routers(trainer):
            gate.weight.add_(0.005 * torch.randn_like(gate.weight))  # (a third of its scale)
    errors = []
    for replay in (False, True):
        batch = collate(trajs, TOK.pad_token_id, version=0, with_routes=replay)
        assert bool(logprobs_module.shared_prefixes(batch, batch["attention"].sum(-1).tolist())) == shared
        with torch.no_grad():
            logp, _ = logprobs_module.token_logprobs(trainer, batch, temperature=1.0)
        mask = batch["mask"] > 0
        errors.append(float((logp - batch["behav"])[mask].abs().max()))
    assert errors[1] < errors[0] / 10


def test_a_replaying_trainer_refuses_samples_without_routing():
    trajs = _engine_samples(moe(), [TOK("1+2=")["input_ids"]])
    trajs[1].routing = None
    with pytest.raises(ContractError, match="1 of the batch's 2 samples carry no routing"):
        collate(trajs, TOK.pad_token_id, version=0, with_routes=True)


def test_routing_packs_to_bytes_and_back():
    routes = torch.tensor([[[0, 7], [3, 1]], [[-1, -1], [-1, -1]]], dtype=torch.int16)
    packed = routing.pack(routes)
    assert packed["dtype"] == "uint8" and torch.equal(routing.unpack(packed), routes.long())
    many = torch.tensor([[[300, 2]]], dtype=torch.int16)  # (more than 255 experts: two bytes an index)
    assert routing.pack(many)["dtype"] == "int16"
    assert torch.equal(routing.unpack(routing.pack(many)), many.long())
    with pytest.raises(ValueError, match="not a packed"):
        routing.unpack({"shape": [2, 2], "dtype": "uint8", "data": "AA=="})


@pytest.fixture(scope="module")
def moe_policy(tmp_path_factory) -> str:
    """A tiny Qwen3-MoE warm-started for a few steps through `warmstart.architecture = "qwen3_moe"`."""
    from asyncrl.policy.warmstart import warmstart

    out = tmp_path_factory.mktemp("model") / "moe"
    cfg = load_config(overrides=["--warmstart.architecture", "qwen3_moe", "--warmstart.steps", "20",
                                 "--warmstart.hidden_size", "32", "--warmstart.layers", "2",
                                 "--warmstart.batch_size", "16"])
    warmstart(cfg, out, log=lambda *a, **k: None)
    return str(out)


def test_a_moe_run_replays_the_engines_routing(moe_policy, tmp_path):
    """Served by the built-in engine in bfloat16 (R3's case: the trainer is in float32), every trained
    sample carries its tokens' experts (all but the last token's), and the trainer replays them. (Each
    new version's bfloat16 copy must hash as the engine holds it: until this test, serving in
    bfloat16 without patches refused every version.)"""
    cfg = job_config(tmp_path, moe_policy, **{"run.steps": 3, "rollout.max_staleness": 1,
                                              "trainer.routing_replay": True, "task.eval_size": 0,
                                              "inference.dtype": "bfloat16"})
    run_dir = train(cfg, log=lambda *a, **k: None)
    for step in range(cfg.run.steps):
        for t in read_batch(RunDir(run_dir).batch(step)):
            assert routing.unpack(t.routing).shape == (len(t.tokens) - 1, 2, 2)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    fresh = [r["mismatch_kl"] for r in steps if "step" in r and r["mismatch_kl"] == r["mismatch_kl"]]
    # (steps with tokens of the version they train: not NaN); bfloat16 against float32 arithmetic leaves
    # ~1e-5 with replay (benchmarks/routing_replay.py)
    assert fresh and max(map(abs, fresh)) < 1e-3


def test_routing_replay_is_refused_where_it_cannot_work():
    on = ["--trainer.routing_replay", "true"]
    with pytest.raises(ConfigError, match="activation_checkpointing = false"):
        load_config(overrides=on + ["--trainer.activation_checkpointing", "true"])


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int32"])
def test_vllms_routed_experts_unpack_to_the_same_indices(dtype):
    """vLLM (--enable-return-routed-experts) returns each choice's experts as a base64 .npy file; the client
    packs them as the built-in engine does. A malformed one is refused with what it is."""
    import base64
    import io

    import numpy as np

    experts = np.random.default_rng(0).integers(0, 128, size=(7, 3, 2)).astype(dtype)
    buffer = io.BytesIO()
    np.save(buffer, experts)
    packed = routing.from_npy(base64.b64encode(buffer.getvalue()).decode())
    assert torch.equal(routing.unpack(packed), torch.from_numpy(experts.astype(np.int64)))
    with pytest.raises(ValueError, match="not a base64 .npy"):
        routing.from_npy("bm90IG5weQ==")


def _other_moe(architecture: str):
    """A tiny random Qwen2-MoE, Mixtral or OLMoE built from its transformers config (8 experts, top-2)."""
    from transformers import AutoModelForCausalLM, MixtralConfig, OlmoeConfig, Qwen2MoeConfig

    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=64)
    config = {"qwen2_moe": lambda: Qwen2MoeConfig(**common, num_experts=8, moe_intermediate_size=16,
                                                  shared_expert_intermediate_size=16, intermediate_size=32),
              "mixtral": lambda: MixtralConfig(**common, num_local_experts=8, intermediate_size=16),
              "olmoe": lambda: OlmoeConfig(**common, num_experts=8, intermediate_size=16)}[architecture]()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("architecture", ["qwen2_moe", "mixtral", "olmoe"])
def test_the_other_replayable_routers_record_their_top_k_and_replay_it(architecture):
    """Qwen2-MoE, Mixtral and OLMoE (routing.REPLAYABLE): recorded = the router's own top-k; replaying
    them changes nothing; under a perturbed router, replay holds the logprobs (as for Qwen3-MoE). Seeded,
    deterministic: replay cuts the drift 12× (Qwen2-MoE), 9.5× (Mixtral), 29× (OLMoE); asked: 3×."""
    model = _other_moe(architecture)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with routing.record(routing.routers(model)) as calls, torch.no_grad():
        out = model(ids, output_router_logits=True)
    indices = torch.stack(calls[0])
    for recorded, logits in zip(calls[0], out.router_logits):
        assert torch.equal(recorded.long(), torch.topk(logits.float(), 2, dim=-1).indices)
    reference = logprobs(model, ids)
    with routing.replay(model, indices):
        assert torch.allclose(logprobs(model, ids), reference, atol=1e-6)
    torch.manual_seed(2)
    with torch.no_grad():
        for gate in routing.routers(model):
            gate.weight.add_(gate.weight.std() * torch.randn_like(gate.weight))
    drifted = (logprobs(model, ids) - reference).abs().max()
    with routing.replay(model, indices):
        replayed = (logprobs(model, ids) - reference).abs().max()
    assert replayed < drifted / 3, (float(replayed), float(drifted))
