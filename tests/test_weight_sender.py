"""The trainer's NCCL weight sender (inference.weight_transfer = "nccl"), as far as it runs without a GPU:
the config it needs, the size of a replica's NCCL group, and its endpoint's refusals — no token, a
malformed request, a version not yet published — reached through the vLLM client that calls it. The
broadcast itself needs GPUs and vLLM; it is not run here (asyncrl/transports/weight_sender.py says so)."""
import asyncio
import json
import urllib.error
import urllib.request

import pytest
import torch

from asyncrl.config import ConfigError, load_config
from asyncrl.control.access import ensure_token
from asyncrl.inference.client import InferenceError
from asyncrl.inference.vllm_client import VLLMClient
from asyncrl.rundir import RunDir
from asyncrl.transports.weight_sender import Sender, vllm_workers

NCCL = ["--inference.engine", "vllm", "--inference.update_policy", "finish", "--inference.weight_transfer",
        "nccl", "--trainer.device", "cuda"]


def test_nccl_needs_vllm_a_gpu_trainer_and_the_local_launcher():
    load_config(overrides=NCCL)
    for change, unmet in (
            (["--inference.engine", "builtin", "--inference.update_policy", "interrupt"],
             "needs inference.engine = 'vllm' \\(got 'builtin'\\)$"),
            (["--trainer.device", "cpu"], "needs trainer.device = 'cuda' \\(got 'cpu'\\)$"),
            (["--run.launcher", "ray"], "needs run.launcher = 'local' \\(got 'ray'\\)$")):
        with pytest.raises(ConfigError, match="weight_transfer = 'nccl'.*" + unmet):  # (only what is unmet)
            load_config(overrides=NCCL + change)


def test_a_replicas_group_counts_its_tensor_and_pipeline_ranks():
    assert vllm_workers([]) == 1
    assert vllm_workers(["--tensor-parallel-size", "4", "--max-model-len", "4096"]) == 4
    assert vllm_workers(["-tp=2", "--pipeline-parallel-size", "2"]) == 4


def post(url: str, body, token: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(url + "/send_weights", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_sender_refuses_what_it_must_not_send(tmp_path):
    token = ensure_token(tmp_path)
    cfg = load_config(overrides=NCCL + ["--timeouts.weight_load", "5"])
    sender = Sender(cfg, tmp_path)
    try:
        url = json.loads(RunDir(tmp_path).weight_sender.read_text())["url"]
        assert url.startswith("http://127.0.0.1:")  # loopback only
        request = {"replica": "http://127.0.0.1:1", "incarnation": "a", "version": 3}
        assert post(url, request, None)[0] == 401
        assert post(url, request, "another token")[0] == 401
        status, body = post(url, {"replica": "x"}, token)
        assert status == 400 and "incarnation" in body["error"]
        status, body = post(url, request, token)
        assert status == 409 and "has not published version 3 yet (newest: None)" in body["error"]

        sender.publish(2, {"w": torch.zeros(2)})
        status, body = post(url, request, token)
        assert status == 409 and "newest: 2" in body["error"]

        # the orchestrator's side: the client names the replica it serves and reports the refusal
        client = VLLMClient("http://127.0.0.1:1", 10, model="m", sender=RunDir(tmp_path).weight_sender,
                            token=token)
        with pytest.raises(InferenceError, match="refused broadcasting version 3 to http://127.0.0.1:1 over"):
            asyncio.run(client._pushed(3, timeout=10))
    finally:
        sender.server.shutdown()


def test_the_client_says_when_the_sender_is_not_up(tmp_path):
    client = VLLMClient("http://127.0.0.1:1", 10, model="m", sender=RunDir(tmp_path).weight_sender, token="t")
    with pytest.raises(InferenceError, match="weight sender has not said where it listens"):
        asyncio.run(client._pushed(1, timeout=5))
