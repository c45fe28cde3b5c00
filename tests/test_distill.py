"""On-policy distillation: a teacher's scores are a plain forward of the teacher; a student trained on them
gets better; a teacher SIGKILLed mid-run is restarted and no sample is trained without its scores; a
teacher that cannot work is refused before anything starts."""
import asyncio
import json
import shutil
import subprocess
import sys
import urllib.request

import pytest
import torch
from conftest import inference_server, job_args, job_config

from asyncrl.config import ConfigError, load_config
from asyncrl.observe.events import read_events
from asyncrl.policy.model import load_policy
from asyncrl.run.chaos import Chaos
from asyncrl.run.preflight import check_teacher
from asyncrl.store.ledger import audit

# The student's held-out accuracy, 100 items, with `opd` from the teacher, over 24 steps: a gain of
# 0.23-0.28 in 5 runs, 3 of them under load (mean 0.25, sd 0.02: the 0.08 asserted is 8 sd below); the
# teacher itself is at 0.52. With noise of 1.0 × std the student started at 0.39 (the tiny policy it is made
# from had changed since this was measured), 0.13 below the teacher: gains of 0.12-0.13 alone, 0.06 in a
# full suite run (a red CI from noise).
NOISE = 1.2  # × each matrix's std: the student at 0.24 held out
RUN = {"run.steps": 24, "rollout.prompts_per_step": 8, "rollout.group_size": 4, "task.eval_size": 100,
       "task.eval_every": 12, "trainer.lr": 1e-4, "trainer.warmup_steps": 2, "objective.name": "opd"}


@pytest.fixture(scope="module")
def weak_student(tiny_model, tmp_path_factory) -> str:
    """The tiny policy with noise on every matrix but the embeddings: the student, with the teacher's
    tokenizer and a held-out accuracy of 0.30 to the teacher's 0.52."""
    model, tokenizer = load_policy(tiny_model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.add_(torch.randn(p.shape, generator=g) * p.std() * NOISE)
    out = tmp_path_factory.mktemp("student") / "weak"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_teachers_scores_are_a_plain_forward_of_the_teacher(tiny_model, tmp_path):
    model, _ = load_policy(tiny_model)
    seqs, starts = [[5, 17, 40, 3, 99, 12, 7], [8, 9, 10, 11]], [3, 1]
    with inference_server(tmp_path, tiny_model) as (url, _):
        status, body = post(url + "/v1/score", {"sequences": seqs, "start": starts, "top_k": 4})
        assert status == 200, body
        bad, error = post(url + "/v1/score", {"sequences": seqs, "start": [3, 4]})
    assert bad == 400 and "'start'" in error["error"]["message"]
    for seq, start, got in zip(seqs, starts, body["scores"]):
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0, :-1].float(), -1)
        want = logp[start - 1:].gather(1, torch.tensor(seq[start:])[:, None]).squeeze(1)
        assert got["logprobs"] == pytest.approx(want.tolist(), abs=1e-4)
        values, ids = logp[start - 1:].topk(4, dim=-1)
        assert [top[0] for top in got["top"]] == ids.tolist()
        torch.testing.assert_close(torch.tensor([top[1] for top in got["top"]]), values, atol=1e-4, rtol=0)


@pytest.mark.long
def test_opd_teaches_the_student_and_a_killed_teacher_is_restarted(weak_student, tiny_model, tmp_path,
                                                                   record):
    cfg = job_config(tmp_path, weak_student, **RUN, **{"teacher.path": tiny_model})
    cmd = [sys.executable, "-m", "asyncrl.cli", "train",
           *job_args(tmp_path, weak_student, **RUN, **{"teacher.path": tiny_model})]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    chaos = Chaos(cfg.run_dir, [("teacher-0", 6)], seed=3)
    chaos.start()
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    assert [k["role"] for k in chaos.kills] == ["teacher-0"]
    restarted = [e["target"] for e in read_events(cfg.run_dir) if e["event"] == "role_restarted"]
    assert restarted == ["teacher-0"]
    report = audit(cfg.run_dir, cfg.rollout.max_staleness, distilled=True)
    assert report["problems"] == [] and report["trained_without_teacher"] == 0, report
    assert report["samples_by_state"]["committed"] == 24 * 8 * 4
    records = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    accuracy = [r["eval_accuracy"] for r in records if "eval_accuracy" in r]
    record("held_out_gain", accuracy[-1] - accuracy[0], threshold=0.08)
    assert accuracy[-1] - accuracy[0] >= 0.08, accuracy
    steps = [r for r in records if "reverse_kl" in r]
    assert all(0 <= r["teacher_share"] <= 1 for r in steps)
    busy = [r["teacher_busy"] for r in steps if "teacher_busy" in r]  # (none while the teacher is down)
    assert len(busy) >= len(steps) - 4 and all(0 < b < 1 for b in busy)


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(tiny_model, calc_model, tmp_path):
    cfg = job_config(tmp_path, tiny_model, **{"teacher.path": calc_model, "objective.name": "opd"})
    with pytest.raises(ConfigError) as refused:
        check_teacher(cfg)
    message = str(refused.value)
    assert calc_model in message and tiny_model in message and "cross-tokenizer" in message


def test_a_teacher_whose_context_cannot_hold_a_sample_is_refused(tiny_model, tmp_path):
    short = tmp_path / "short"
    shutil.copytree(tiny_model, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16}))
    cfg = job_config(tmp_path, tiny_model, **{"teacher.path": str(short), "objective.name": "opd"})
    with pytest.raises(ConfigError, match="16 positions"):
        check_teacher(cfg)


def test_an_external_teacher_without_its_token_is_refused(tiny_model, tmp_path):
    with pytest.raises(ConfigError, match="teacher.token_file"):
        load_config(overrides={"teacher": {"path": tiny_model, "url": "http://10.0.0.7:8"}})
    missing = job_config(tmp_path, tiny_model, **{"teacher.path": tiny_model, "teacher.url": "http://10.0.0.7:8",
                                                   "teacher.token_file": str(tmp_path / "no_such_token")})
    with pytest.raises(ConfigError, match="missing or empty"):
        check_teacher(missing)
    with pytest.raises(ConfigError, match="set teacher.path"):
        load_config(overrides={"objective": {"name": "opd"}})


def test_a_hinted_turn_is_scored_with_its_hint_in_the_teachers_context(tiny_model, tmp_path):
    """Hindsight: an episode's first turn carries a hint of what came next; the teacher scores that turn
    after the hint, and every other sampled token in the episode's own context."""
    from asyncrl.agents.episode import Episode, Limits
    from asyncrl.observe.events import EventLog
    from asyncrl.orchestrator.teacher import Teacher
    from asyncrl.rundir import RunDir
    from asyncrl.trajectory import Trajectory

    model, tokenizer = load_policy(tiny_model)
    ep = Episode(Limits(max_turns=4, max_tokens=64, max_tokens_per_turn=8))
    with pytest.raises(ValueError, match="not taken a turn"):
        ep.hint("too early")
    ep.add_context([5, 17, 40, 3])
    ep.add_sampled([99, 12], [-0.5, -0.6], [0, 0])
    ep.add_context([7, 8])
    ep.hint("(this guess leaves 9-15) ")  # about the first turn: the latest sampled one
    ep.add_sampled([30, 31, 32], [-0.1] * 3, [0] * 3)
    traj = Trajectory("0-0", "0", "t", 0, ep.tokens, ep.loss_mask, ep.logprobs, ep.versions,
                      info={"hints": ep.hints})
    hint_ids = tokenizer.encode("(this guess leaves 9-15) ", add_special_tokens=False)

    def forward(seq: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0, :-1].float(), -1)

    with inference_server(tmp_path, tiny_model) as (url, run_dir):
        cfg = job_config(tmp_path, tiny_model, **{"teacher.path": tiny_model, "teacher.url": url,
                                                  "teacher.token_file": str(RunDir(run_dir).token)})
        teacher = Teacher(cfg, run_dir, tokenizer, EventLog(run_dir, "test"))

        async def score() -> None:
            try:
                await teacher.score([traj])
            finally:
                await teacher.close()

        asyncio.run(score())
    plain, hinted = forward(ep.tokens), forward(ep.tokens[:4] + hint_ids + ep.tokens[4:6])
    h = len(hint_ids)
    want = [0.0] * 4 + [hinted[3 + h + i, tok].item() for i, tok in enumerate(ep.tokens[4:6])] + [0.0] * 2 \
        + [plain[8 + i - 1, tok].item() for i, tok in enumerate(ep.tokens[8:])]
    assert traj.teacher_logprobs == pytest.approx(want, abs=1e-4)
    unhinted = [plain[3 + i, tok].item() for i, tok in enumerate(ep.tokens[4:6])]
    assert traj.teacher_logprobs[4:6] != pytest.approx(unhinted, abs=1e-3)  # the hint changed the scores
