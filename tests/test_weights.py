"""Versioned weights: hashes and sparse patches reconstruct bit-identical weights."""
import pytest
import torch
from safetensors.torch import load_file

from asyncrl.rundir import RunDir
from asyncrl.transports import weights


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_published_file_is_safetensors(tmp_path, dtype):
    """What the trainer writes reads back with safetensors' own loader, bit for bit, any shape."""
    gen = torch.Generator().manual_seed(1)
    state = {"w": torch.randn(3, 5, generator=gen), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4),
             "b": torch.randn(7, generator=gen)}
    state = {k: v.to(dtype) for k, v in state.items()}
    digest = weights.publish(tmp_path, 1, state, {"step": 0})
    back = load_file(RunDir(tmp_path).weights_file(1))
    assert list(back) == list(state) and weights.state_hash(back) == digest == weights.state_hash(state)
    assert all(back[k].shape == v.shape and back[k].dtype == v.dtype for k, v in state.items())


def test_pruned_file_is_written_over_by_the_next_version(tmp_path):
    """The oldest pruned version's file becomes the next version's, rewritten whole: a smaller state
    leaves no bytes of the bigger one behind."""
    big = {"w": torch.randn(1000), "v": torch.randn(10)}
    small = {"w": torch.randn(10)}
    for version in (1, 2, 3):
        weights.publish(tmp_path, version, big, {})
    weights.prune(tmp_path, 3, keep=2)  # drops version 1, keeps its file as the spare
    assert not RunDir(tmp_path).weights_file(1).exists()
    spare = RunDir(tmp_path).weights / ".spare.safetensors"
    inode = spare.stat().st_ino
    weights.publish(tmp_path, 4, small, {})
    path = RunDir(tmp_path).weights_file(4)
    assert path.stat().st_ino == inode and not spare.exists()
    assert torch.equal(load_file(path)["w"], small["w"]) and list(load_file(path)) == ["w"]
    assert weights.read_marker(tmp_path, 4)["hash"] == weights.state_hash(small)
    assert torch.equal(load_file(RunDir(tmp_path).weights_file(3))["w"], big["w"])  # the kept ones intact


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finiteness_check_is_exact(dtype):
    """The trainer's check before it publishes: any inf or nan anywhere is caught, and finite weights
    whose sum overflows are not mistaken for broken ones."""
    from asyncrl.trainer.main import all_finite

    good = [torch.randn(50, 3).to(dtype), torch.randn(7).to(dtype)]
    assert all_finite(good) and all_finite([])
    for bad in (float("nan"), float("inf"), -float("inf")):
        broken = [t.clone() for t in good]
        broken[1][4] = bad
        assert not all_finite(broken)
    big = torch.full((4,), 3e38).to(dtype)  # finite, but their sum is not
    assert all_finite(good + [big])
    assert not all_finite(good + [torch.tensor([3e38, float("inf"), -float("inf")]).to(dtype)])
