"""The trainer's output layer works through chunks of positions (asyncrl/trainer/step.py: chunked_head):
logprobs, entropies and the gradients of a loss over both are those of the whole-vocabulary softmax over
all positions at once, whatever the chunk size, with and without the entropy's gradient."""
import pytest
import torch

from asyncrl.config import load_config
from asyncrl.objectives import get_objective
from asyncrl.policy.model import load_policy
from asyncrl.trainer.logprobs import token_logprobs
from asyncrl.trainer.step import collate, train_step
from asyncrl.trajectory import Trajectory
from asyncrl.transports import weights


def batch_of(vocab: int) -> dict:
    g = torch.Generator().manual_seed(0)
    trajs = []
    for i, (prompt, answer) in enumerate([(5, 9), (3, 4), (7, 12), (4, 1)]):  # rows of different lengths
        tokens = torch.randint(3, vocab, (prompt + answer,), generator=g).tolist()
        trajs.append(Trajectory(str(i), "g", "t", 0, tokens, [0] * prompt + [1] * answer,
                                [0.0] * (prompt + answer), [-1] * prompt + [0] * answer))
    return collate(trajs, pad_id=0, version=0)


def reference(model, batch: dict, temperature: float):
    """The plain computation: every row's logits over the whole vocabulary, one log-softmax."""
    logits = model(input_ids=batch["tokens"], attention_mask=batch["attention"]).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return logprobs.gather(-1, batch["targets"][..., None]).squeeze(-1), entropy


def gradients(model, logp, entropy, batch) -> list[torch.Tensor]:
    model.zero_grad()
    mask = batch["mask"]
    ((logp * batch["advantages"].clamp(min=0.1) + 0.01 * entropy) * mask).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def assert_same_gradients(got: list, want: list) -> None:
    """Equal up to float summation order: within 1e-4 of each tensor's largest entry (7e-6 measured)."""
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * float(w.abs().max()))


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunks_of_the_output_layer_change_nothing(tiny_model, entropy_grad):
    model, tokenizer = load_policy(tiny_model)
    vocab = model.get_output_embeddings().weight.shape[0]
    batch = batch_of(len(tokenizer))
    mask = batch["mask"] > 0
    ref_logp, ref_entropy = reference(model, batch, 0.7)
    ref_entropy = ref_entropy if entropy_grad else ref_entropy.detach()
    ref_grads = gradients(model, ref_logp, ref_entropy, batch)
    for chunk_positions in (1, 7, 10**6):  # one position per chunk, chunks across rows, all in one
        logp, entropy = token_logprobs(model, batch, 0.7, entropy_grad, chunk_values=chunk_positions * vocab)
        torch.testing.assert_close(logp[mask], ref_logp[mask], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(entropy[mask], ref_entropy[mask], rtol=1e-5, atol=1e-5)
        assert entropy.requires_grad == entropy_grad
        assert_same_gradients(gradients(model, logp, entropy, batch), ref_grads)
    assert max(float(g.abs().max()) for g in ref_grads) > 1e-3  # the comparison is of real gradients
    assert "forward" not in vars(model.get_output_embeddings())  # the layer is itself again


def grouped_trajectories(vocab: int) -> list[Trajectory]:
    """Two groups of eight samples with one prompt each and answers of 1 to 12 tokens, four agent episodes
    that share only their first turn (then turns of their own, of different lengths), and two rows alone."""
    g = torch.Generator().manual_seed(1)
    draw = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    trajs = []

    def add(group: str, prompt: list[int], rest: list[int], answer_mask: list[int]) -> None:
        tokens, mask = prompt + rest, [0] * len(prompt) + answer_mask
        trajs.append(Trajectory(f"{group}{len(trajs)}", group, "t", 0, tokens, mask, [0.0] * len(tokens),
                                [-1] * len(prompt) + [0] * len(rest),
                                advantages=[0.0] * len(prompt) + [0.5 - len(trajs) % 3 * 0.4] * len(rest)))

    for group in ("a", "b"):
        prompt = draw(100)
        for answer in (1, 5, 12, 3, 7, 2, 9, 4):
            add(group, prompt, draw(answer), [1] * answer)
    first_turn = draw(80)
    for own in (4, 9, 2, 5):  # the answer, a tool's reply (not trained), a second answer
        add("episode", first_turn, draw(own) + draw(6) + draw(own + 1), [1] * own + [0] * 6 + [1] * (own + 1))
    for alone in (20, 33):
        add(f"alone{alone}", draw(alone), draw(4), [1] * 4)
    return trajs


def grouped_batch(vocab: int) -> dict:
    return collate(grouped_trajectories(vocab), pad_id=0, version=0)


def tokens_through(model) -> list[int]:
    counted = []
    model.register_forward_pre_hook(lambda m, args, kwargs: counted.append(kwargs["input_ids"].numel()),
                                    with_kwargs=True)
    return counted


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_a_groups_shared_prompt_goes_through_the_model_once_and_changes_nothing(tiny_model, entropy_grad):
    model, tokenizer = load_policy(tiny_model)
    batch = grouped_batch(len(tokenizer))
    counted = tokens_through(model)
    plain_logp, plain_entropy = token_logprobs(model, batch, 0.7, entropy_grad, buckets=False)
    plain_grads = gradients(model, plain_logp, plain_entropy, batch)
    plain_tokens = sum(counted)
    counted.clear()
    logp, entropy = token_logprobs(model, batch, 0.7, entropy_grad)
    shared_tokens = sum(counted)
    lengths = batch["attention"].sum(-1)
    scored = torch.arange(logp.shape[1])[None] < (lengths - 1)[:, None]  # every position with a target
    torch.testing.assert_close(logp[scored], plain_logp[scored], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy[scored], plain_entropy[scored], rtol=1e-5, atol=1e-5)
    assert_same_gradients(gradients(model, logp, entropy, batch), plain_grads)
    # each group's shared tokens went through once (2 x 99 + 79 instead of 16 x 99 + 4 x 79: 1623 fewer),
    # against every token of every row (2135), padding included (891 measured)
    assert shared_tokens < int(lengths.sum()) - 1000 < plain_tokens, (shared_tokens, plain_tokens)


def test_the_teachers_top_k_ids_get_the_students_logprobs_from_the_same_logits(tiny_model):
    """For opd_topk: log π of a teacher's top-k ids at each position, in one call and in length buckets, are
    the whole-vocabulary log-softmax's, and the logprobs of the targets do not change."""
    model, tokenizer = load_policy(tiny_model)
    batch = grouped_batch(len(tokenizer))
    g = torch.Generator().manual_seed(2)
    batch["top_ids"] = torch.randint(len(tokenizer), (*batch["targets"].shape, 3), generator=g)
    want_logp, _ = reference(model, batch, 0.7)
    logits = model(input_ids=batch["tokens"], attention_mask=batch["attention"]).logits[:, :-1].float()
    want_top = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, batch["top_ids"])
    lengths = batch["attention"].sum(-1)
    scored = torch.arange(want_logp.shape[1])[None] < (lengths - 1)[:, None]
    for buckets in (False, True):
        logp, _, top = token_logprobs(model, batch, 0.7, buckets=buckets)
        torch.testing.assert_close(logp[scored], want_logp[scored], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(top[scored], want_top[scored], rtol=1e-5, atol=1e-5)
        assert top.requires_grad


@pytest.mark.parametrize("objective,minibatches,kl_coef", [("decoupled_ppo", 2, 0.0), ("m2po", 1, 0.05)])
def test_training_steps_with_shared_prompts_are_the_same_steps(tiny_model, objective, minibatches, kl_coef):
    """A whole train_step — the proximal logprobs recomputed, the KL anchor's logprobs, the loss, the
    optimizer step — with trainer.share_prefixes on and off."""
    results = []
    for share in (True, False):
        torch.manual_seed(0)
        model, tokenizer = load_policy(tiny_model)
        ref_model = load_policy(tiny_model)[0].eval().requires_grad_(False) if kl_coef else None
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        counted = tokens_through(model)
        cfg = load_config(overrides=["--objective.name", objective, "--objective.prox", "recompute",
                                     "--trainer.minibatches", str(minibatches), "--objective.kl_coef",
                                     str(kl_coef), "--trainer.share_prefixes", str(share).lower()])
        trajs = grouped_trajectories(len(tokenizer))
        metrics = train_step(model, optimizer, get_objective(objective), trajs, 0, cfg, 0, ref_model)
        results.append((metrics, weights.model_state(model), sum(counted)))
    (shared, shared_state, shared_tokens), (plain, plain_state, plain_tokens) = results
    assert shared_tokens < 0.7 * plain_tokens, (shared_tokens, plain_tokens)  # the prompts were shared
    assert shared.keys() == plain.keys()
    for key, value in plain.items():
        assert shared[key] == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True), key
    for key in plain_state:  # (Adam's noise on near-zero gradients: see tests/test_ranks.py)
        torch.testing.assert_close(shared_state[key], plain_state[key], rtol=1e-4, atol=3e-5)


def test_the_trainers_warm_up_changes_nothing(tiny_model):
    """The forward and backward before the trainer is ready leave the weights, their gradients and the
    RNG stream as they were (a restart replays steps bit for bit from a checkpoint's RNG state)."""
    from asyncrl.trainer.ranks import Ranks
    from asyncrl.trainer.step import warm_up

    model, tokenizer = load_policy(tiny_model)
    model.train()
    before = weights.state_hash(weights.model_state(model))
    torch.manual_seed(7)
    rng = torch.get_rng_state()
    cfg = load_config(overrides=["--rollout.prompts_per_step", "2", "--rollout.group_size", "3"])
    warm_up(model, cfg, tokenizer.pad_token_id, Ranks())
    assert weights.state_hash(weights.model_state(model)) == before
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
