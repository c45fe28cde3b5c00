"""Images in, text out: a tiny Qwen2.5-VL through the engine, the trainer, the server and a short real run.

The policy is built from its config with random weights (a second): what these tests check is that
engine and trainer see the same pixels and positions, not that the policy is any good
(benchmarks/vision.py measures learning)."""
import base64
import io
import json
from pathlib import Path

import pytest
import torch
from conftest import TESTS, built_once, inference_server, job_config

from asyncrl.config import ConfigError
from asyncrl.config.sections import TaskConfig
from asyncrl.inference.engine import Engine, SamplingParams, Sequence
from asyncrl.rewards.tasks import BadTaskRow, TaskSource, checked_prompt, encode_prompt
from asyncrl.trainer.logprobs import token_logprobs
from asyncrl.trainer.step import collate
from asyncrl.trajectory import Trajectory
from asyncrl.vision import inputs as vision
from asyncrl.vision.images import MAX_PIXELS
from asyncrl.vision.prompts import ImagePrompts

SHAPES = "asyncrl.vision.shapes:largest_colour"


def _build(out) -> None:
    from asyncrl.policy.model import build_bpe_tokenizer, chatml_corpus
    from asyncrl.vision.shapes import COLOURS, QUESTION
    from asyncrl.vision.tiny import add_vision_tokens, build_tiny_vlm

    tokenizer = build_bpe_tokenizer(chatml_corpus([QUESTION, " ".join(COLOURS)] * 20), 320)
    add_vision_tokens(tokenizer)
    model, processor = build_tiny_vlm(tokenizer, hidden_size=64, layers=2, heads=4, kv_heads=2,
                                      vision_width=32)
    for part in (model, tokenizer, processor):
        part.save_pretrained(out)


@pytest.fixture(scope="session")
def vision_model(tmp_path_factory) -> str:
    return built_once(tmp_path_factory, "vision", _build)


@pytest.fixture(scope="module")
def policy(vision_model):
    from asyncrl.policy.model import load_policy

    model, tokenizer = load_policy(vision_model)
    return model, tokenizer, ImagePrompts(vision_model, model.config, tokenizer)


def _prompts(policy, n: int):
    _, tokenizer, images = policy
    tasks = TaskSource(TaskConfig(name=SHAPES), seed=0)
    return [checked_prompt(tasks, tasks.item(i), tokenizer, 256, i, images) for i in range(n)]


def test_engine_and_trainer_logprobs_equal_a_plain_forward_with_the_images(policy):
    model, tokenizer, images = policy
    entries = _prompts(policy, 3)
    engine = Engine(model, tokenizer.pad_token_id, tokenizer.eos_token_id, seed=1)
    text_only = encode_prompt(tokenizer, "red or blue?", chat=True)
    seqs = [Sequence(ids, SamplingParams(max_tokens=5), images=images.shown(e["image_hashes"]))
            for e, ids in entries for _ in range(2)] + [Sequence(text_only, SamplingParams(max_tokens=5))]
    engine.add(seqs)
    while any(s.sample.finish_reason is None for s in seqs):
        engine.step()
    # the two samples of a prompt shared one prefill: each distinct (tokens, images) went through once
    assert engine.tokens_prefilled == sum(len(ids) for _, ids in entries) + len(text_only)
    trajs, placeholders = [], vision.placeholders(model.config)
    with torch.no_grad():
        for k, s in enumerate(seqs):
            ids = torch.tensor([s.tokens])
            shown = {"pixel_values": torch.cat([p.pixels for p in s.images]),
                     "image_grid_thw": torch.stack([p.grid for p in s.images]),
                     "mm_token_type_ids": (ids == model.config.image_token_id).int()} if s.images else {}
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **shown).logits[0, :-1]
            logits[:, placeholders] = -torch.inf  # (the image tokens are not the policy's to sample)
            plain = torch.log_softmax(logits.float(), -1).gather(-1, ids[0, 1:, None])[len(s.prompt) - 1:, 0]
            assert not set(s.sample.token_ids) & set(placeholders)
            assert torch.allclose(torch.tensor(s.sample.logprobs), plain, atol=1e-5), k
            n = len(s.prompt)
            trajs.append(Trajectory(
                str(k), str(k // 2), "shapes", k // 2, s.tokens, [0] * n + [1] * len(s.sample.token_ids),
                [0.0] * n + s.sample.logprobs, [-1] * n + s.sample.versions,
                images=[p.digest for p in s.images] or None))
    pictures = {p.digest: p for s in seqs for p in s.images}
    batch = collate(trajs, tokenizer.pad_token_id, 0, pictures=pictures.__getitem__)
    for share in (True, False):  # the shared-prefix forward and one call per length bucket
        with torch.no_grad():
            logp, _ = token_logprobs(model, batch, 1.0, share_prefixes=share)
        assert float(((logp - batch["behav"]) * batch["mask"]).abs().max()) < 1e-5
    with pytest.raises(Exception, match="text-only"):
        collate(trajs, tokenizer.pad_token_id, 0)  # a trainer without a vision-language policy


def test_bad_images_name_the_row_and_the_file(policy, tmp_path):
    from PIL import Image

    _, tokenizer, images = policy
    Image.new("RGB", (40, 40), (0, 0, 255)).save(tmp_path / "ok.png")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")
    big = tmp_path / "huge.png"
    Image.new("1", (4097, 4097)).save(big)  # (a few KB on disk, more pixels than allowed)
    buffer = io.BytesIO()
    Image.new("RGB", (40, 40)).save(buffer, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    rows = [{"prompt": "Colour?", "answer": "blue", "images": ["ok.png"]},
            {"prompt": "Colour?", "answer": "blue", "images": ["broken.png"]},
            {"prompt": "Colour?", "answer": "blue", "images": ["missing.png"]},
            {"prompt": "Colour?", "answer": "blue", "images": ["huge.png"]},
            {"prompt": "Colour?", "answer": "blue", "images": "ok.png"},
            {"prompt": "Colour?", "answer": "black", "images": [uri]}]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    tasks = TaskSource(TaskConfig(name="jsonl", path=str(path)))
    entry, ids = checked_prompt(tasks, tasks.item(0), tokenizer, 256, 0, images)
    # (40 px is brought up to the processor's smallest, 56 px: 4 x 4 patches, 2 x 2 after the merge)
    assert ids.count(images.config.image_token_id) == 4 and len(entry["image_hashes"]) == 1
    for row, words in ((1, "does not decode"), (2, "does not exist"), (3, f"limit is {MAX_PIXELS}"),
                       (4, "must be a list")):
        with pytest.raises(BadTaskRow, match=rf"rows.jsonl row {row + 1}.*{words}"):
            checked_prompt(tasks, tasks.item(row), tokenizer, 256, row, images)
    assert checked_prompt(tasks, tasks.item(5), tokenizer, 256, 5, images)[0]["image_hashes"]
    with pytest.raises(BadTaskRow, match="row 1 shows 1 image.*text-only"):
        checked_prompt(tasks, tasks.item(0), tokenizer, 256, 0)


def test_a_text_only_policy_given_images_is_refused_before_roles_start(tiny_model, tmp_path):
    from asyncrl.run.preflight import check_inputs

    cfg = job_config(tmp_path, tiny_model, **{"task.name": SHAPES})
    with pytest.raises(ConfigError, match=rf"task '{SHAPES}' shows images.*{tiny_model}.*text-only"):
        check_inputs(cfg, log=lambda *a, **k: None)


def test_a_replica_asks_once_for_images_it_has_not_seen(vision_model, policy, tmp_path):
    """The server finds images by hash; one it lacks (a remote replica's case) it asks for, and the client
    sends the request again with the bytes; bytes that are not the image their hash names are refused."""
    import asyncio

    from asyncrl.inference.client import InferenceClient, InferenceError

    entries = _prompts(policy, 2)
    store = policy[2].store  # (in memory: the server's run directory has none of them)
    asked = []

    def read(digest: str) -> bytes:
        asked.append(digest)
        return store.get(digest)

    async def ask(url, hashes, reader):
        async with InferenceClient(url, 60) as client:
            return await client.complete([ids for _, ids in entries], 2, 4, 1.0, images=hashes,
                                         image_bytes=reader)

    with inference_server(tmp_path, vision_model) as (url, _):
        hashes = [e["image_hashes"] for e, _ in entries]
        choices = asyncio.run(ask(url, hashes, read))
        assert len(choices) == 4 and sorted(asked) == sorted(h for hs in hashes for h in hs)
        asked.clear()
        asyncio.run(ask(url, hashes, read))
        assert asked == []  # (the server keeps what it was sent)
        with pytest.raises(InferenceError, match="holds other bytes"):
            asyncio.run(ask(url, [["0" * 32], hashes[1]], lambda d: b"not the image"))


@pytest.mark.e2e
def test_a_short_run_trains_on_images_stored_once(vision_model, tmp_path):
    from asyncrl.run.launcher import train
    from asyncrl.rundir import RunDir
    from asyncrl.trajectory import read_batch

    cfg = job_config(tmp_path, vision_model, **{
        "task.name": SHAPES, "task.verifier": "asyncrl.vision.shapes:names_colour", "task.eval_size": 8,
        "run.steps": 5, "rollout.max_tokens": 3, "rollout.max_staleness": 1, "run.prune_trained": True,
        "trainer.checkpoint_every": 1, "trainer.keep_checkpoints": 2})
    run_dir = RunDir(train(cfg, log=lambda *a, **k: None))
    kept = [step for step, _ in run_dir.batch_files()]
    assert kept and kept[0] > 0  # (the batches a durable checkpoint holds were pruned)
    shown = set()
    for step in kept:
        for t in read_batch(run_dir.batch(step)):
            assert t.images and len(t.images) == 1  # (a hash: the picture itself is stored once)
            shown.update(t.images)
    stored = {p.name for p in run_dir.images.iterdir()}
    # every image a batch on disk shows is there; the others are the held-out set's and those of groups
    # still generating at the end (at most η + 1 steps' prompts): the pruned batches' went with them
    assert shown <= stored and len(stored - shown) <= 8 + 2 * 4
    metrics = [json.loads(line) for line in run_dir.metrics.read_text().splitlines()]
    assert all(r["mismatch_kl"] < 1e-6 for r in metrics if "mismatch_kl" in r and r["step"] == 0)


@pytest.mark.e2e
def test_a_gui_agent_sees_a_new_screen_every_turn(vision_model, tmp_path):
    """examples/agents/gui.py on the random tiny policy: every request of an episode carries its screens so
    far, the trajectory shows each once in token order, and the trainer trains on them (that the agent
    learns is benchmarks/vision.py's: warm start, 60 steps, 3 seeds)."""
    from asyncrl.config import load_config
    from asyncrl.run.launcher import train
    from asyncrl.rundir import RunDir
    from asyncrl.trajectory import read_batch

    cfg = load_config(TESTS.parent / "examples/agents/gui_tiny.toml", overrides=[
        "--model.path", vision_model, "--model.warmstart_if_missing", "false", "--run.steps", "3",
        "--rollout.prompts_per_step", "4",
        "--rollout.group_size", "2", "--task.eval_size", "4", "--trainer.threads", "1",
        "--inference.threads", "1", "--run.root", str(tmp_path / "runs")])
    run_dir = RunDir(train(cfg, log=lambda *a, **k: None))
    pad = json.loads((Path(vision_model) / "config.json").read_text())["image_token_id"]
    for step in range(cfg.run.steps):
        for t in read_batch(run_dir.batch(step)):
            assert len(t.images) == 2 and len(set(t.images)) == 2  # (a new screen in the second turn)
            assert t.tokens.count(pad) == 2 * 9  # (two 84 px screens, 9 tokens each)
            assert all(m == 0 for tok, m in zip(t.tokens, t.loss_mask) if tok == pad)
    assert json.loads(run_dir.summary.read_text())["ledger"]["problems"] == []
