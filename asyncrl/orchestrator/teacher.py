"""On-policy distillation's scoring: the teacher's logprobs of each finished sample's tokens.

A group is scored as soon as its samples are rewarded, while the rest of the run generates: the
orchestrator records the group in the ledger (and so lets a batch take it) only once every sample
carries `teacher_logprobs`. A teacher that is down, wedged or restarting is retried with backoff (its
URL re-read: a restarted one may bind another port) until timeouts.teacher; past it the run stops with
the reason, and the groups not yet scored are generated again on resume. Nothing is trained unscored.

Hindsight (OpenClaw-RL): a turn of an agent's episode may carry a hint built from what came next
(`info["hints"]`: {"start", "end", "text"}); that turn's tokens are scored with the hint's tokens placed
right before them in the teacher's context. The student's own tokens and context are unchanged.
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

from asyncrl.control.access import read_token
from asyncrl.inference import replica
from asyncrl.inference.client import InferenceClient, InferenceError, InferenceUnavailable
from asyncrl.inference.scoring import HINT_TOKENS
from asyncrl.trajectory import Trajectory


class TeacherUnavailable(RuntimeError):
    pass


class Teacher:
    def __init__(self, cfg, run_dir: Path, tokenizer, events):
        self.cfg, self.run_dir, self.tokenizer, self.events = cfg, run_dir, tokenizer, events
        t = cfg.teacher
        self.token = Path(t.token_file).read_text().strip() if t.url else read_token(run_dir)
        self.limit = asyncio.Semaphore(t.max_concurrent)
        self.clients: dict[str, InferenceClient] = {}
        self.turn = 0  # round robin over the teachers
        self.seconds = 0.0  # wall seconds of scoring requests, summed (they overlap generation)
        self.requests = self.retries = 0

    def _urls(self) -> list[str]:
        if self.cfg.teacher.url:
            return [self.cfg.teacher.url]
        infos = (replica.read_info(self.run_dir, i, "teacher") for i in range(self.cfg.teacher.replicas))
        return [info["url"] for info in infos if info]

    async def _client(self, url: str) -> InferenceClient:
        if url not in self.clients:
            client = InferenceClient(url, self.cfg.timeouts.http, self.token)
            self.clients[url] = await client.__aenter__()
        return self.clients[url]

    async def close(self) -> None:
        for client in self.clients.values():
            await client.__aexit__(None, None, None)

    async def score(self, group: list[Trajectory]) -> None:
        """Fill every sample's teacher_logprobs (and teacher_top with teacher.top_k), the group in one
        request; raises TeacherUnavailable when the teacher cannot answer within timeouts.teacher."""
        began, top_k = time.monotonic(), self.cfg.teacher.top_k
        spans = [span for row, t in enumerate(group) for span in self._spans(row, t)]
        answers = await self._request([seq for _, _, _, seq, _ in spans], [start for *_, start in spans],
                                      f"group {group[0].group_id}") if spans else []
        scored = [([0.0] * len(t.tokens), [[] for _ in t.tokens] if top_k else None) for t in group]
        for (row, lo, hi, _, _), answer in zip(spans, answers):  # (a hint's span overwrites the plain one)
            logprobs, top = scored[row]
            logprobs[lo:hi] = answer["logprobs"]
            if top is not None:
                top[lo:hi] = answer["top"]
        for t, (logprobs, top) in zip(group, scored):
            t.teacher_logprobs = [lp if m else 0.0 for lp, m in zip(logprobs, t.loss_mask)]
            t.teacher_top = [x if m else [] for x, m in zip(top, t.loss_mask)] if top is not None else None
            t.info["score_seconds"] = round(time.monotonic() - began, 4)

    def _spans(self, row: int, traj: Trajectory) -> list[tuple]:
        """(row, lo, hi, sequence, start) for each part of a sample the teacher scores: its tokens from the
        first sampled one on, then each hinted turn lo:hi again with its hint right before it."""
        mask = traj.loss_mask
        if 1 not in mask:
            return []
        first = mask.index(1)
        spans = [(row, first, len(mask), traj.tokens, first)]
        for hint in traj.info.get("hints") or ():
            ids = self.tokenizer.encode(hint["text"], add_special_tokens=False)[-HINT_TOKENS:]
            lo, hi = hint["start"], hint["end"]
            spans.append((row, lo, hi, traj.tokens[:lo] + ids + traj.tokens[lo:hi], lo + len(ids)))
        return spans

    async def _request(self, seqs: list[list[int]], starts: list[int], what: str) -> list[dict]:
        """The sequences' scores from whichever teacher answers, retried until timeouts.teacher."""
        deadline = self.cfg.timeouts.teacher
        end, backoff, last = time.monotonic() + deadline, 0.25, "no teacher has written its URL yet"
        while True:
            urls = self._urls()
            if urls:
                url = urls[self.turn % len(urls)]
                self.turn += 1
                try:
                    async with self.limit:
                        began = time.monotonic()
                        answer = await self._ask(await self._client(url), seqs, starts)
                        self.seconds += time.monotonic() - began
                    self.requests += 1
                    return answer
                except InferenceUnavailable as e:  # down, restarting or wedged: retry
                    last = str(e)
                except InferenceError as e:  # it answered, and refused: the same request would be refused
                    raise TeacherUnavailable(f"teacher: {what} could not be scored: {e}") from None
            if time.monotonic() + backoff > end:
                raise TeacherUnavailable(
                    f"teacher: {what} could not be scored within {deadline:.0f}s (timeouts.teacher): {last}")
            self.retries += 1
            if self.retries == 1 or self.retries % 50 == 0:  # (said once, then now and then: no flood)
                self.events.write("teacher_retry", retries=self.retries, error=last[:300])
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, 5.0)

    async def _ask(self, client: InferenceClient, seqs: list[list[int]], starts: list[int]) -> list[dict]:
        top_k = self.cfg.teacher.top_k
        if self.cfg.teacher.engine == "vllm":  # (for teacher.url: what that server is)
            return list(await asyncio.gather(*(vllm_score(client, self.cfg.teacher.path, seq, start, top_k)
                                               for seq, start in zip(seqs, starts))))
        body = {"sequences": seqs, "start": starts, "top_k": top_k}
        scores = (await client._call("POST", "/v1/score", "a scoring request", json=body)).get("scores")
        if not (isinstance(scores, list) and len(scores) == len(seqs)):
            raise InferenceError(f"teacher {client.url} answered {len(seqs)} sequences with {scores!r:.100}")
        return scores

    async def stats(self) -> dict:
        """Scoring seconds and requests, and the teachers' own busy seconds and uptime (from /stats)."""
        out = {"teacher_seconds": round(self.seconds, 3), "teacher_requests": self.requests,
               "teacher_retries": self.retries}
        busy = up = 0.0
        for url in self._urls() if self.cfg.teacher.engine == "builtin" else ():  # (vLLM has no /stats)
            try:
                stats = await (await self._client(url)).stats()
            except InferenceError:
                continue
            busy += stats.get("score_seconds", 0.0)
            up += stats.get("uptime_seconds", 0.0)
        if up:  # (summed over the teachers: a run's profile shows the teacher role's total)
            out.update({"teacher_busy": round(busy / up, 4), "time/teacher/score": round(busy, 4),
                        "time/teacher/uptime": round(up, 4)})
        return out


async def vllm_score(client: InferenceClient, model: str, seq: list[int], start: int, top_k: int) -> dict:
    """A vLLM server's prompt logprobs as /v1/score's answer: logprob j is token start + j's."""
    body = {"model": model, "prompt": seq, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": top_k}
    choice = (await client._call("POST", "/v1/completions", "a scoring request", json=body))["choices"][0]
    per_position = choice.get("prompt_logprobs") or []
    if len(per_position) != len(seq):
        raise InferenceError(f"teacher {client.url} returned {len(per_position)} prompt logprobs for "
                             f"{len(seq)} tokens (is it vLLM, serving {model}?)")
    answer = {"logprobs": [per_position[i][str(seq[i])]["logprob"] for i in range(start, len(seq))]}
    if top_k:
        answer["top"] = []
        for i in range(start, len(seq)):
            ranked = sorted(per_position[i].items(), key=lambda kv: kv[1].get("rank", 0))[:top_k]
            answer["top"].append([[int(k) for k, _ in ranked], [v["logprob"] for _, v in ranked]])
    return answer
