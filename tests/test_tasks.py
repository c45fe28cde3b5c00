"""The held-out split, the default verifier and the warm start's teacher (deterministic)."""
import math
import random

from asyncrl.config import load_config
from asyncrl.rewards.tasks import eval_entries, item_key, load_tasks
from asyncrl.rewards.teachers import drops_overflow
from asyncrl.rewards.verifiers import last_number


def keys(tasks, entries):
    return {item_key(tasks.prompt(e), e) for e in entries}


def test_held_out_items_are_never_drawn_for_training_or_the_warm_start():
    cfg = load_config().task
    held = load_tasks(cfg, held_out=True)
    evaluated = eval_entries(held, 500)
    assert len(keys(held, evaluated)) == len(evaluated) == 500  # distinct
    for seed in (cfg.seed, 7920, 12345):  # RL's stream, the warm start's, any other
        train = load_tasks(cfg, seed=seed)
        drawn = keys(train, [train.item(i) for i in range(3000)])
        assert not drawn & keys(held, evaluated)
    # without the split, two generator seeds share items: the reason it exists
    unsplit = cfg.model_copy(update={"holdout": 0.0})
    a, b = load_tasks(unsplit, seed=1), load_tasks(unsplit, seed=2)
    assert keys(a, [a.item(i) for i in range(2000)]) & keys(b, [b.item(i) for i in range(2000)])


def test_the_split_holds_out_about_its_share_of_distinct_items():
    cfg = load_config().task
    train, held = load_tasks(cfg, seed=3), load_tasks(cfg, held_out=True)
    train_keys = keys(train, [train.item(i) for i in range(20000)])
    held_keys = keys(held, eval_entries(held, 2000))
    share = len(held_keys) / (len(held_keys) + len(train_keys))
    assert 0.07 < share < 0.13, share  # 8,100 sums, ~10% held out


def test_last_number_scores_only_the_final_integer():
    entry = {"answer": 136}
    assert last_number("136", entry) == 1.0
    assert last_number("84+52=136", entry) == 1.0
    assert last_number("136, no: 36", entry) == 0.0
    assert last_number("1360", entry) == 0.0 and last_number("", entry) == 0.0
    assert last_number("so -17", {"answer": "-17"}) == 1.0


class Always(random.Random):
    def __init__(self, value: float):
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


def test_drops_overflow_slips_only_in_the_first_token():
    item = {"answer": "136", "metadata": {"expression": "84 + 52"}}
    assert drops_overflow(item, Always(0.0)) == "36"  # a slip: the carry out of the tens is dropped
    assert drops_overflow(item, Always(0.99)) == "136"  # no slip
    no_carry = {"answer": "96", "metadata": {"expression": "84 + 12"}}
    assert drops_overflow(no_carry, Always(0.0)) == "96"  # nothing to drop
    assert drops_overflow({"answer": "-17", "metadata": {"expression": "25 - 42"}}, Always(0.0)) == "17"
    assert drops_overflow({"answer": "7"}, Always(0.0)) == "7"  # no expression: answered right


def test_a_prompt_the_tokenizer_cannot_encode_is_a_bad_row_naming_file_row_and_characters(tmp_path):
    import pytest

    from asyncrl.policy.model import build_char_tokenizer
    from asyncrl.rewards.tasks import BadTaskRow

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "12+3=", "answer": 15}\n{"prompt": "１2+3🙂=", "answer": 15}\n')
    cfg = load_config(overrides=["--task.name", "jsonl", "--task.path", str(rows)]).task
    tasks, tok = load_tasks(cfg), build_char_tokenizer()
    assert tok.decode(tasks.prompt_ids(tasks.item(0), tok), skip_special_tokens=True).endswith("12+3=\nA:")
    with pytest.raises(BadTaskRow) as err:
        tasks.prompt_ids(tasks.item(1), tok)
    assert f"{rows} row 2" in str(err.value) and "'１🙂'" in str(err.value)


def test_a_reward_is_any_real_number_and_nothing_else():
    """Verifiers and agents may return bool, int, float, numpy or one-element tensor scalars; a string,
    None or a list breaks the contract (the caller stops the run)."""
    import numpy as np
    import torch

    from asyncrl.rewards.tasks import as_number

    good = [True, 1, 0.5, np.float32(0.25), np.int64(3), torch.tensor(1.0)]
    assert [as_number(v) for v in good] == [1.0, 1.0, 0.5, 0.25, 3.0, 1.0]
    assert [as_number(v) for v in ["1", b"1", None, [1.0], torch.tensor([1.0, 2.0])]] == [None] * 5
    assert math.isnan(as_number(float("nan")))  # a number: a dropped sample, not a broken contract
