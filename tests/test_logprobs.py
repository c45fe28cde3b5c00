"""The trainer's output layer works through chunks of positions (asyncrl/trainer/step.py: chunked_head):
logprobs, entropies and the gradients of a loss over both are those of the whole-vocabulary softmax over
all positions at once, whatever the chunk size, with and without the entropy's gradient."""
import pytest
import torch

from asyncrl.model import load_policy
from asyncrl.trainer.step import collate, token_logprobs
from asyncrl.trajectory import Trajectory


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
        for got, want in zip(gradients(model, logp, entropy, batch), ref_grads):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert max(float(g.abs().max()) for g in ref_grads) > 1e-3  # the comparison is of real gradients
    assert "forward" not in vars(model.get_output_embeddings())  # the layer is itself again
