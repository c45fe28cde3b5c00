"""Versioned weights: hashes and sparse patches reconstruct bit-identical weights."""
import pytest
import torch

from asyncrl import weights


def states(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    old = {"a": torch.randn(64, 32, generator=gen), "b": torch.randn(100, generator=gen)}
    new = {k: v + 1e-4 * torch.randn(v.shape, generator=gen) for k, v in old.items()}  # an RL-sized step
    return weights.cast_state(old, dtype), weights.cast_state(new, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_patch_reconstructs_bit_identical_weights(dtype):
    served, new = states(dtype)
    patch, changed, total = weights.make_patch(served, new)
    rebuilt = {k: v.clone() for k, v in served.items()}
    weights.apply_patch(rebuilt, patch)
    assert weights.state_hash(rebuilt) == weights.state_hash(new)
    assert all(torch.equal(rebuilt[k].view(torch.uint8), new[k].view(torch.uint8)) for k in new)
    assert total == 64 * 32 + 100
    patch_bytes = sum(t.numel() * t.element_size() for t in patch.values())
    assert patch_bytes == changed * (4 + new["a"].element_size())  # an int32 index and a value each
    if dtype == torch.bfloat16:
        assert changed / total < 0.2  # most small updates vanish below bf16 rounding
    if dtype == torch.float32:
        assert changed / total > 0.9  # fp32 serving sees nearly every update


def test_patch_is_exact_for_nan_and_signed_zero():
    served = {"x": torch.tensor([0.0, 1.0, float("nan")])}
    new = {"x": torch.tensor([-0.0, 1.0, float("nan")])}
    patch, changed, _ = weights.make_patch(served, new)
    assert changed == 1  # −0.0 differs bitwise from 0.0; nan equals the same nan
    weights.apply_patch(served, patch)
    assert weights.state_hash(served) == weights.state_hash(new)


def test_hash_tells_states_apart():
    a, b = states(torch.float32)
    assert weights.state_hash(a) != weights.state_hash(b)
    assert weights.state_hash(a) == weights.state_hash({k: v.clone() for k, v in a.items()})
