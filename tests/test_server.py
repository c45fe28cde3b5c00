"""The inference server as a real process over real HTTP."""
import asyncio

import pytest
import torch
from conftest import inference_server

from asyncrl.control.access import read_token
from asyncrl.inference.client import InferenceClient, InferenceError
from asyncrl.policy.model import load_policy
from asyncrl.rundir import RunDir
from asyncrl.trainer.logprobs import token_logprobs
from asyncrl.trainer.step import collate
from asyncrl.trajectory import Trajectory
from asyncrl.transports import weights

TOKEN = {}  # url -> the run's token


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    with inference_server(tmp_path_factory.mktemp("srv"), tiny_model) as (url, run_dir):
        TOKEN[url] = read_token(run_dir)
        yield url, run_dir, tiny_model


def call(coro_fn, url, token=True):
    async def go():
        async with InferenceClient(url, timeout=30, token=TOKEN.get(url) if token else None) as client:
            await client.wait_healthy(30)
            return await coro_fn(client)

    return asyncio.run(go())


def test_completion_shape_and_logprobs_match_the_trainer(server):
    url, _, model_path = server
    model, tok = load_policy(model_path)
    prompt = tok("12+30=")["input_ids"]
    choices = call(lambda c: c.complete([prompt], n=3, max_tokens=5, temperature=1.0), url)
    assert len(choices) == 3
    trajs = []
    for ch in choices:
        assert len(ch["token_ids"]) == len(ch["logprobs"]["token_logprobs"]) == len(ch["versions"]) >= 1
        assert ch["finish_reason"] in ("stop", "length")
        n = len(ch["token_ids"])
        trajs.append(Trajectory("x", "g", "t", 0, prompt + ch["token_ids"], [0] * len(prompt) + [1] * n,
                                [0.0] * len(prompt) + ch["logprobs"]["token_logprobs"],
                                [-1] * len(prompt) + ch["versions"]))
    batch = collate(trajs, tok.pad_token_id, version=0)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, temperature=1.0)
    # the trainer's logprobs of the same version equal the engine's (no train-inference mismatch)
    assert torch.allclose(logp * batch["mask"], batch["behav"], atol=1e-4)


def test_updated_weights_equal_the_trainers(server):
    url, run_dir, model_path = server
    model, _ = load_policy(model_path)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    digest = weights.publish(run_dir, 1, weights.model_state(model), {})

    async def update_and_read(client):
        before = await client.version(with_hash=True)
        await client.update_weights(
            {"path": str(RunDir(run_dir).weights_file(1)), "version": 1, "hash": digest}, 30
        )
        return before, await client.version(with_hash=True)

    before, after = call(update_and_read, url)
    assert before["hash"] != digest
    assert after == {"version": 1, "hash": digest}
    choices = call(lambda c: c.complete([[1, 5, 6]], n=2, max_tokens=3, temperature=1.0), url)
    assert all(v == 1 for ch in choices for v in ch["versions"])


@pytest.mark.parametrize("body, message", [
    ({"prompt": [1, 5, 100000]}, "token ids must be integers"),
    ({"prompt": [1, -3]}, "token ids must be integers"),
    ({"prompt": []}, "'prompt' must be"),
    ({"prompt": [5] * 1000}, "the limit is"),
    ({"prompt": [1, 5], "max_tokens": -1}, "'max_tokens' must be a positive integer"),
    ({"prompt": [1, 5], "n": 0}, "'n' must be a positive integer"),
    ({"prompt": [1, 5], "top_p": 0}, "'top_p'"),
])
def test_malformed_requests_get_400_and_do_not_disturb_others(server, body, message):
    url = server[0]

    async def bad_then_good(client):
        bad = client._call("POST", "/v1/completions", "a bad request", json=body)
        good = client.complete([[1, 5, 6]], n=1, max_tokens=3, temperature=1.0)
        return await asyncio.gather(bad, good, return_exceptions=True)

    bad, good = call(bad_then_good, url)
    assert isinstance(bad, InferenceError) and "(400)" in str(bad) and message in str(bad)
    assert isinstance(good, list) and len(good) == 1


def test_unreachable_server_fails_fast_with_its_name():
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now

    async def go():
        async with InferenceClient(f"http://127.0.0.1:{port}", timeout=2) as client:
            await client.complete([[1, 2]], 1, 2, 1.0)

    with pytest.raises(InferenceError, match=f"inference server http://127.0.0.1:{port} unreachable"):
        asyncio.run(go())


def test_busy_answers_are_retried_until_the_deadline_and_odd_bodies_are_named():
    """A real HTTP server that says 429 (with Retry-After), then 503, then answers; one that is busy for
    ever; one that answers with an HTML page; one healthy with an empty answer (vLLM's /health, which the
    odd-body check took for an error until it was run against vLLM). Deterministic: counts of requests."""
    from aiohttp import web

    seen = {"busy_twice": 0, "busy": 0}

    async def busy_twice(request):
        seen["busy_twice"] += 1
        if seen["busy_twice"] == 1:
            return web.json_response({"error": {"message": "full"}}, status=429, headers={"Retry-After": "0"})
        if seen["busy_twice"] == 2:
            return web.Response(text="<html>starting</html>", status=503)
        return web.json_response({"choices": [{"token_ids": [1]}]})

    async def busy(request):
        seen["busy"] += 1
        return web.json_response({"error": {"message": "still full"}}, status=429)

    async def html(request):
        return web.Response(text="<html>bad gateway</html>", status=502)

    async def empty(request):  # (vLLM's /health: 200 and no body)
        return web.Response(status=200)

    async def go():
        app = web.Application()
        app.router.add_post("/ok/v1/completions", busy_twice)
        app.router.add_post("/busy/v1/completions", busy)
        app.router.add_post("/html/v1/completions", html)
        app.router.add_get("/empty/health", empty)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        outcomes = []
        try:
            for path in ("ok", "busy", "html"):
                async with InferenceClient(f"{base}/{path}", timeout=2) as client:
                    try:
                        outcomes.append(await client.complete([[1]], 1, 1, 1.0))
                    except InferenceError as e:
                        outcomes.append(e)
            async with InferenceClient(f"{base}/empty", timeout=2) as client:
                await client.wait_healthy(2)  # (an empty answer is healthy, not an odd body)
        finally:
            await runner.cleanup()
        return outcomes

    ok, busy_error, html_error = asyncio.run(go())
    assert ok == [{"token_ids": [1]}] and seen["busy_twice"] == 3
    assert isinstance(busy_error, InferenceError) and "(429, busy for 2s): still full" in str(busy_error)
    assert seen["busy"] >= 2  # retried (0.25 s, 0.5 s, ...) until the next wait would pass the deadline
    assert isinstance(html_error, InferenceError) and "(502): <html>bad gateway" in str(html_error)


def test_patch_update_reproduces_the_trainers_weights(server):
    url, run_dir, model_path = server
    model, _ = load_policy(model_path)

    async def current(client):
        return await client.version(with_hash=True)

    base_version = call(current, url)["version"]
    # the server holds either version 0 (model_path) or 1 (the test above); rebuild that state
    if base_version == 1:
        model.load_state_dict(weights.load(RunDir(run_dir).weights_file(1)), strict=False)
    served = weights.cast_state(weights.model_state(model), torch.float32)
    with torch.no_grad():
        first = next(model.parameters())
        first.view(-1)[:10] += 0.5  # a sparse change
    new = weights.cast_state(weights.model_state(model), torch.float32)
    patch, changed, total = weights.make_patch(served, new)
    assert changed == 10
    v = base_version + 1
    weights.save_patch(run_dir, v, patch)
    digest = weights.publish(run_dir, v, new, {})
    body = {"path": str(RunDir(run_dir).weights_file(v)), "version": v, "hash": digest,
            "patch": str(RunDir(run_dir).patch(v)), "base_version": base_version}

    async def update(client):
        out = await client.update_weights(body, 30)
        return out, await client.version(with_hash=True)

    out, after = call(update, url)
    assert out["loaded_from"] == "patch" and after == {"version": v, "hash": digest}
    # a patch for a version the server does not hold falls back to the full weights
    weights.publish(run_dir, v + 1, new, {})
    stale = {
        **body,
        "version": v + 1,
        "base_version": v - 5,
        "path": str(RunDir(run_dir).weights_file(v + 1)),
    }
    out, after = call(lambda c: _update_then_hash(c, stale), url)
    assert out["loaded_from"] == "full" and after["hash"] == digest


async def _update_then_hash(client, body):
    out = await client.update_weights(body, 30)
    return out, await client.version(with_hash=True)


def test_pause_resume_abort(server):
    url = server[0]

    async def go(client):
        await client._call("POST", "/pause", "pause")
        pending = asyncio.create_task(client.complete([[1, 5, 6]], n=2, max_tokens=50, temperature=1.0))
        arrived = None

        async def queued() -> bool:
            nonlocal arrived
            arrived = await client.stats()
            return arrived["waiting"] + arrived["running"] >= 2

        deadline = asyncio.get_running_loop().time() + 30
        while not await queued():  # the request reaches the paused server (however loaded the machine)
            assert asyncio.get_running_loop().time() < deadline, arrived
            await asyncio.sleep(0.02)
        assert not pending.done()  # paused: nothing is generated
        stats = arrived
        await client._call("POST", "/abort", "abort")
        choices = await pending
        await client._call("POST", "/resume", "resume")
        after = await client.complete([[1, 5, 6]], n=1, max_tokens=3, temperature=1.0)
        return stats, choices, after

    stats, choices, after = call(go, url)
    assert stats["waiting"] + stats["running"] >= 2
    assert [c["finish_reason"] for c in choices] == ["abort", "abort"]
    assert after[0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("streamed", [False, True])
def test_a_request_whose_client_goes_away_stops_generating(server, streamed):
    """Cancelled on the client (a group retried, a run stopping): the server drops its sequences
    instead of generating them for no one. Paused, so the request is certainly still waiting."""
    url = server[0]

    async def go(client):
        await client._call("POST", "/pause", "pause")
        pending = asyncio.create_task(
            client.complete_groups([[1, 5, 6], [1, 5]], 3, 50, 1.0, 1.0, lambda *_: None) if streamed
            else client.complete([[1, 5, 6]], n=6, max_tokens=50, temperature=1.0))
        deadline = asyncio.get_running_loop().time() + 30
        while (await client.stats())["waiting"] < 6:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.02)
        pending.cancel()  # the connection closes: the server cancels the request's handler
        while (stats := await client.stats())["waiting"] > 0:
            assert asyncio.get_running_loop().time() < deadline, stats
            await asyncio.sleep(0.02)
        await client._call("POST", "/resume", "resume")
        return stats

    stats = call(go, url)
    assert stats["waiting"] == 0 and stats["running"] == 0


def test_streamed_groups_come_each_as_soon_as_it_is_done(server):
    """A request of several prompts with "stream_groups": a prompt's n samples come as soon as they are
    all done, while the others still generate. Greedy decoding (deterministic): of a few prompts, one
    the policy ends at once and one it runs to max_tokens, asked in the opposite order. Which prompts
    those are depends on the policy (and on float sums at a greedy tie), so there are many candidates: of
    27, two builds of the default policy ran 5 and 8 to max_tokens and ended 16 and 7 within 8 tokens."""
    url, _, model_path = server
    _, tok = load_policy(model_path)
    texts = ("hello world", "12+30=", "7", "3+4= 7", "the", "+", "==", "1+", "99+99+99=", "0000", "9" * 20)
    candidates = [tok(text)["input_ids"] for text in texts] + [[k] * 10 for k in range(3, 60, 4)]
    greedy = call(lambda c: c.complete(candidates, n=1, max_tokens=600, temperature=0.0), url)
    outcomes = [(p, ch["finish_reason"], len(ch["token_ids"])) for p, ch in zip(candidates, greedy)]
    short = [p for p, finish, length in outcomes if finish == "stop" and length < 9]
    long = [p for p, finish, _ in outcomes if finish == "length"]
    assert short and long, [(len(ch["token_ids"]), ch["finish_reason"]) for ch in greedy]

    async def stream(client):
        arrivals = []

        def arrived(i, choices):  # (the long group still has ~580 steps to go: the stats call is early)
            arrivals.append((i, choices, asyncio.ensure_future(client.stats())))

        await client.complete_groups([long[0], short[0]], 2, 600, 0.0, 1.0, arrived)
        return [(i, choices, await stats) for i, choices, stats in arrivals]

    (first, choices, stats), (second, rest, _) = call(stream, url)
    assert (first, second) == (1, 0)  # the short group first, though asked second
    assert stats["running"] == 2  # ... while the long one's two samples were still generating
    assert [c["prompt_index"] for c in choices] == [1, 1] and [c["index"] for c in choices] == [2, 3]
    assert all(c["finish_reason"] == "stop" for c in choices)
    assert all(len(c["token_ids"]) == 600 and c["finish_reason"] == "length" for c in rest)
    assert choices[0]["token_ids"] == greedy[candidates.index(short[0])]["token_ids"]


def test_admin_calls_need_the_runs_token_and_load_only_the_runs_own_weights(server, tmp_path):
    """Without the token: 401 on what changes the served policy, generation still open on loopback.
    With it: a path outside the run's weights/ is refused (any local process could name any file),
    and a file missing some of the model's tensors is refused instead of half-loaded."""
    url, run_dir, model_path = server
    state = weights.model_state(load_policy(model_path)[0])
    weights.publish(tmp_path, 7, state, {})
    outside = run_dir.parent / "elsewhere.safetensors"  # reached from weights/ by ../..
    outside.write_bytes(RunDir(tmp_path).weights_file(7).read_bytes())
    partial = RunDir(run_dir).weights_file(8)
    weights.publish(run_dir, 8, dict(list(state.items())[:-2]), {})

    async def anonymous(client):
        refused = [await client._request("POST", path, "x", 10) for path in ("/pause", "/update_weights")]
        return refused, await client.complete([[1, 5, 6]], n=1, max_tokens=2, temperature=1.0)

    async def foreign(client):
        errors = []
        for body in ({"path": str(RunDir(tmp_path).weights_file(7)), "version": 7},
                     {"path": f"{run_dir}/weights/../../{outside.name}", "version": 7},
                     {"path": str(partial), "version": 8}):
            try:
                await client.update_weights(body, 30)
            except InferenceError as e:
                errors.append(str(e))
        return errors, await client.version()

    refused, generated = call(anonymous, url, token=False)
    assert [status for status, _, _ in refused] == [401, 401] and "RUN_DIR/token" in str(refused[0][1])
    assert generated[0]["finish_reason"] in ("stop", "length")
    errors, version = call(foreign, url)
    assert len(errors) == 3 and version["version"] != 7 and version["version"] != 8
    assert all("a server loads only files under its run's weights/" in e for e in errors[:2]), errors
    assert "does not hold this model's weights: 2 tensors missing" in errors[2], errors[2]
