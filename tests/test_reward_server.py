"""engine/rewards/server.py as a real process (a tiny reward model and the verifiers, behind a
token and limits) against an in-process forward of the same model; engine/rewards/remote.py's
retries and protocol checks, and the trainer's token, against small servers in this process."""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest
import torch
import uvicorn
from fastapi import FastAPI, Response
from transformers import AutoModelForTokenClassification, AutoTokenizer

from engine.data.chat import tokenize_pairs
from engine.rewards import sandbox
from engine.rewards.components import RewardComponents, RewardsConfigError, RewardsUnavailable, ScoringBatch
from engine.rewards.remote import RewardServerClient, RewardServerError, ScoreItem
from engine.rewards.server import build_app, check_sandbox, code_section, main, parse_args
from engine.rewards.server_access import TOKEN_ENV, Limits
from engine.run_config.rewards import CodeReward, RewardsSection

REPO = Path(__file__).resolve().parent.parent
RIVER = [{"role": "user", "content": "Describe the river."}]
KITCHEN = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Describe the kitchen."}]
ITEMS = [  # two responses share each prompt: the server packs a prompt once for both
    ScoreItem(prompt=RIVER, response="Warm pleasant river. \\boxed{4}", fields={"answer": "4"}),
    ScoreItem(prompt=RIVER, response="Dirty boring river. #### 1/2", fields={"answer": 0.5, "id": [1, 2]}),
    ScoreItem(prompt=KITCHEN, response="A kitchen. \\boxed{5}", fields={"answer": "4"}),
    ScoreItem(
        prompt=KITCHEN,
        response="```python\ndef f(x):\n    return x + 1\n```",
        fields={"tests": ["assert f(1) == 2", "assert f(2) == 4"]},
    ),
    ScoreItem(  # passes its test, after a sleep past the server's --code-wall-s 3 (not the default 10 s)
        prompt=KITCHEN,
        response="```python\nimport time\ntime.sleep(6)\n\ndef f(x):\n    return x + 1\n```",
        fields={"tests": ["assert f(1) == 2"]},
    ),
]
TOKEN = "s3cret-Token_1"


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """A reward model as train_rm.py saves it (per-token head, heads helpful/harmless), untrained:
    the head drawn at std 1 so that rewards are O(1) and a 1e-5 tolerance means something."""
    from engine.models.loading import load_value_model

    torch.manual_seed(0)
    model = load_value_model(str(tiny_model_dir), components=["helpful", "harmless"])
    torch.nn.init.normal_(model.score.weight, std=1.0)
    out = tmp_path_factory.mktemp("remote_rm") / "model"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


@contextmanager
def server_process(tmp_path: Path, *args: str) -> Iterator[tuple[str, psutil.Process]]:
    """``python -m engine.rewards.server --port 0 ARGS``: (its URL from the ready line, the process);
    stopped by SIGTERM afterwards, which must end it and its reward workers."""
    out, err = tmp_path / "server.out", tmp_path / "server.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine.rewards.server", "--port", "0", *args],
            cwd=REPO,
            stdout=stdout,
            stderr=stderr,
        )
    try:
        deadline = time.monotonic() + 120
        while "reward server: http://" not in out.read_text():
            assert proc.poll() is None, f"the server exited ({proc.returncode}): {err.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"no ready line in 120 s: {err.read_text()[-2000:]}"
            time.sleep(0.1)
        ready = out.read_text().splitlines()[0]
        yield ready.split()[2].rstrip(","), psutil.Process(proc.pid)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, "the verifiers run in reward worker processes"
        proc.terminate()  # SIGTERM
        assert proc.wait(timeout=30) == 0, err.read_text()[-2000:]
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"left running after the server stopped: {alive}"
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()


def in_process_rewards(model_dir: Path, items: list[ScoreItem]) -> torch.Tensor:
    """(N, C) the reference: each conversation alone, unpacked, eager attention, its last token."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForTokenClassification.from_pretrained(model_dir, attn_implementation="eager").eval()
    _, full_ids = tokenize_pairs(tokenizer, [item.prompt for item in items], [item.response for item in items])
    with torch.no_grad():
        return torch.stack([model(input_ids=torch.tensor([ids])).logits[0, -1] for ids in full_ids])


def raw_request(url: str, head: str, body: bytes = b"") -> str:
    """What the server at ``url`` answers first to ``POST /v1/score`` with the token, ``head`` and
    ``body``, which may be the start of a longer body: this never sends the rest."""
    host, port = url.removeprefix("http://").split(":")
    request = f"POST /v1/score HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {TOKEN}\r\n{head}\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(request.encode() + body)
        answer = b""
        while not answer.endswith(b"}") and (chunk := s.recv(65536)):
            answer += chunk
    return answer.decode()


def test_server_scores_like_the_in_process_reward_model(tmp_path, reward_model_dir):
    args = ["--reward-model", str(reward_model_dir), "--math-field", "answer", "--workers", "1", "--code-wall-s", "3"]
    (tmp_path / "token").write_text(f"{TOKEN}\n")
    args += ["--token-file", str(tmp_path / "token"), "--max-items", "5", "--max-chars", "100", "--max-body-mb", "0.01"]
    with server_process(tmp_path, *args, "--format-pattern", r"\\boxed\{", "--code-field", "tests") as (url, _):
        assert url.startswith("http://127.0.0.1:")
        assert httpx.get(f"{url}/v1/health").json() == {"status": "ok", "protocol": 1}  # no token needed
        auth = {"Authorization": f"Bearer {TOKEN}"}
        for headers in ({}, {"Authorization": f"Bearer {TOKEN[:-1]}2"}, {"Authorization": TOKEN}):
            refused = httpx.get(f"{url}/v1/components", headers=headers)
            assert refused.status_code == 401 and refused.json()["detail"].startswith("no valid token"), headers
        with RewardServerClient(url, timeout_s=60, retries=0, token=TOKEN) as client:
            assert client.components() == ["helpful", "harmless", "math", "format", "code"]
            scores = client.score(ITEMS)
            # over the limits: refused at once, naming the limit
            for items, said in (
                (ITEMS + ITEMS[:1], "HTTP 422: 6 items, more than the server's --max-items 5"),
                ([ITEMS[0].model_copy(update={"response": "x" * 101})], "item 0's response has 101 characters"),
                ([ScoreItem(prompt=[{"role": "user", "content": "y" * 101}], response="")], "item 0's prompt has 101"),
                # 2 MB sent whole by the client, which still reads the 413 (its Content-Length)
                ([ITEMS[0].model_copy(update={"fields": {"answer": "4" * 2**21}})], "HTTP 413: a body of 2097"),
            ):
                with pytest.raises(RewardServerError, match=said):
                    client.score(items)
        # refused before the body is read: from its declared length, or once the bytes read pass the limit
        declared = raw_request(url, "Content-Length: 1000000000")
        assert declared.startswith("HTTP/1.1 413") and "a body of 1000000000 bytes, more than" in declared
        streamed = raw_request(url, "Transfer-Encoding: chunked", b"4e20\r\n" + b"x" * 20000)
        assert streamed.startswith("HTTP/1.1 413")
        assert "a body of more than the server's --max-body-mb 0.01 (10485 bytes)" in streamed
        bad = httpx.post(
            f"{url}/v1/score", json={"items": [{"prompt": "hello"}, {"prompt": [{"text": "hi"}]}]}, headers=auth
        )
        assert bad.status_code == 422
        assert [(e["loc"], e["msg"]) for e in bad.json()["detail"]] == [
            (["body", "items", 0, "prompt"], "Input should be a valid list"),
            (["body", "items", 0, "response"], "Field required"),
            (["body", "items", 1, "prompt"], "Value error, message 0 has keys ['text'], not 'role' and 'content'"),
            (["body", "items", 1, "response"], "Field required"),
        ]
    expected = in_process_rewards(reward_model_dir, ITEMS)
    served = torch.tensor([scores["helpful"], scores["harmless"]]).T
    assert expected.abs().max() > 0.5  # rewards of a size that a 1e-5 tolerance tests
    torch.testing.assert_close(served, expected, rtol=1e-5, atol=1e-5)
    assert scores["math"] == [1.0, 1.0, 0.0, None, None]  # 1/2 equals 0.5; the last items have no answer
    assert scores["format"] == [1.0, 0.0, 1.0, 0.0, 0.0]
    # the code passes one of its row's two tests, in the sandbox; the sleeper is killed at --code-wall-s
    assert scores["code"] == [None, None, None, 0.5, 0.0]


def test_server_refuses_a_command_with_nothing_to_serve_a_bad_pattern_or_no_token_beyond_loopback(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    (tmp_path / "empty").write_text("\n")
    for argv, said in (
        (["--port", "0"], "nothing to serve"),
        (["--format-pattern", "(unclosed"], "is not a regular expression"),
        (["--code-field", "tests", "--code-memory-mb", "8"], "--code-memory-mb 8: Input should be greater"),
        (["--math-field", "answer", "--host", "0.0.0.0"], "--host 0.0.0.0 is not a loopback address"),
        (["--math-field", "answer", "--token-file", str(tmp_path / "none")], f"--token-file {tmp_path}/none: cannot"),
        (["--math-field", "answer", "--token-file", str(tmp_path / "empty")], "no usable token: it is empty"),
        (["--math-field", "answer", "--max-items", "0"], "--max-items 0: must be at least 1"),
        (["--math-field", "answer", "--max-body-mb", "nan"], "--max-body-mb nan: must be a size more than 0"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            parse_args(argv)  # main's first step (a check that let a command through starts no server here)
        assert exit_info.value.code == 2
        assert said in capsys.readouterr().err
    assert parse_args(["--math-field", "answer", "--host", "::1"]).token is None  # loopback: a token is optional
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert parse_args(["--math-field", "answer", "--host", "0.0.0.0"]).token == TOKEN
    monkeypatch.setenv(TOKEN_ENV, "two words")
    with pytest.raises(SystemExit):
        parse_args(["--math-field", "answer"])
    assert f"the environment variable {TOKEN_ENV} holds no usable token: it may hold visible ASCII" in (
        capsys.readouterr().err
    )


def test_the_code_limits_default_to_the_trainers():
    assert code_section(parse_args(["--code-field", "tests"])) == CodeReward(field="tests")
    limits = ["--code-cpu-s", "2", "--code-wall-s", "3", "--code-memory-mb", "512", "--allow-unisolated"]
    assert code_section(parse_args(["--code-field", "t", *limits])) == CodeReward(
        field="t", cpu_s=2, wall_s=3.0, memory_mb=512, allow_unisolated=True
    )


def test_code_without_namespaces_is_refused_unless_allowed(monkeypatch, capsys, caplog):
    """Where the sandbox finds only mode "none" (the probe's answer forced), serving code exits 2 naming
    --allow-unisolated before anything loads; with the flag, the isolation is logged as a warning."""
    monkeypatch.setattr(sandbox, "isolation", lambda: "none")
    assert main(["--code-field", "tests", "--workers", "1", "--reward-model", "/nonexistent"]) == 2
    said = capsys.readouterr().err
    assert "reward server: --allow-unisolated is not given and the code sandbox cannot create namespaces" in said
    assert "/nonexistent" not in said  # refused before the reward model loads
    with caplog.at_level(logging.INFO, logger="engine.rewards.server"):
        check_sandbox(allow_unisolated=True)
    assert caplog.records[-1].levelno == logging.WARNING
    assert caplog.records[-1].getMessage().startswith("warning: the code sandbox runs without isolation")


@contextmanager
def in_thread(app: FastAPI) -> Iterator[str]:
    """``app`` served by uvicorn on a free port, in a thread of this process: its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, "127.0.0.1", 0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the in-process server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def scripted(*answers: tuple[int, str]) -> tuple[FastAPI, list[str]]:
    """An app answering its n-th request with ``answers[n]`` (the last one after that), and the
    paths it was asked."""
    app, asked = FastAPI(), []

    @app.api_route("/v1/{path}", methods=["GET", "POST"])
    def answer(path: str) -> Response:
        asked.append(path)
        status, body = answers[min(len(asked), len(answers)) - 1]
        return Response(body, status_code=status, media_type="application/json")

    return app, asked


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_client_retries_with_backoff_then_names_the_url_and_the_attempts():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    start = time.monotonic()
    with pytest.raises(RewardServerError) as error, RewardServerClient(url, timeout_s=5, retries=2, backoff_s=0.1) as c:
        c.score(ITEMS[:1])
    assert time.monotonic() - start >= 0.1 + 0.2
    assert f"reward server {url}/v1/score failed 3 attempts; the last: ConnectError" in str(error.value)


def test_client_retries_a_timeout():
    app = FastAPI()

    @app.get("/v1/components")
    async def slow() -> dict[str, list[str]]:
        await asyncio.sleep(0.5)
        return {"components": []}

    with (
        in_thread(app) as url,
        RewardServerClient(url, timeout_s=0.2, retries=1, backoff_s=0.01) as client,
        pytest.raises(RewardServerError, match="failed 2 attempts; the last: ReadTimeout"),
    ):
        client.components()


def test_client_retries_a_server_error_then_succeeds():
    app, asked = scripted((500, "busy"), (200, '{"scores": {"helpful": [0.5, NaN, -Infinity], "math": [1, 0, null]}}'))
    with in_thread(app) as url, RewardServerClient(url, retries=3, backoff_s=0.05) as client:
        scores = client.score(ITEMS[:3])
    assert asked == ["score", "score"]
    assert scores == {"helpful": [0.5, None, None], "math": [1.0, 0.0, None]}  # NaN and infinities: unscored


@pytest.mark.parametrize(
    ("status", "body", "said"),
    [
        (200, '{"scores": {"helpful": [0.5]}}', "2 items sent, but the scores of {'helpful': 1}"),
        (200, '{"scores": {"helpful": [0.5, "0.7"]}}', "scores.helpful.1: Input should be a valid number, got '0.7'"),
        (200, '{"scores": {"helpful": [true, 1]}}', "scores.helpful.0: Input should be a valid number"),
        (200, '{"score": {}}', "scores: Field required"),
        (200, "<html>hi</html>", "not JSON: '<html>hi</html>'"),
        (404, '{"detail": "Not Found"}', "refused the request: HTTP 404"),
    ],
)
def test_client_refuses_an_answer_outside_the_protocol_at_once(status, body, said):
    app, asked = scripted((status, body))
    with (
        in_thread(app) as url,
        RewardServerClient(url, retries=3, backoff_s=5) as client,
        pytest.raises(RewardServerError) as error,
    ):
        client.score(ITEMS[:2])
    assert asked == ["score"]  # no retry
    assert f"reward server {url}/v1/score" in str(error.value) and said in str(error.value)


class ConstantScorer:
    """Components ``names`` scoring every item ``value``."""

    def __init__(self, names: list[str], value: float):
        self.names, self.value = names, value

    def score(self, items):
        return {name: [self.value] * len(items) for name in self.names}


def test_check_components_names_the_missing_and_the_served():
    app = build_app([ConstantScorer(["helpful", "harmless"], 0.25), ConstantScorer(["math"], math.nan)])
    with in_thread(app) as url, RewardServerClient(url + "/", timeout_s=5) as client:
        client.check_components(["math", "helpful"])
        with pytest.raises(RewardServerError) as error:
            client.check_components(["helpful", "format", "length"])
        # the server's NaN goes out as null
        assert client.score(ITEMS[:2]) == {"helpful": [0.25] * 2, "harmless": [0.25] * 2, "math": [None] * 2}
    assert str(error.value) == (
        f"reward server {url} has no component ['format', 'length']; it serves ['helpful', 'harmless', 'math']"
    )
    with pytest.raises(ValueError, match="clash"):
        build_app([ConstantScorer(["math"], 0.0), ConstantScorer(["math"], 1.0)])


class ForgetfulScorer(ConstantScorer):
    """Serves its components but leaves the last one out of its answers."""

    def score(self, items):
        return {name: [self.value] * len(items) for name in self.names[:-1]}


def test_a_reply_without_a_requested_component_is_a_clean_stop_naming_it():
    app = build_app([ForgetfulScorer(["helpful", "harmless"], 0.25)])
    with in_thread(app) as url:
        section = RewardsSection.model_validate(
            {"remote": {"url": url, "components": {"helpful": 1.0, "harmless": 1.0}}}
        )
        components = RewardComponents(section, max_new_tokens=16)
        try:
            components.check()  # the server lists both
            batch = ScoringBatch([i.prompt for i in ITEMS[:2]], [i.response for i in ITEMS[:2]], [4, 4], [{}, {}])
            said = rf"the reward server at {url} answered without 2 scores of component\(s\) \['harmless'\]"
            with pytest.raises(RewardsUnavailable, match=said):
                components.score(batch)
        finally:
            components.close()


def test_the_trainer_checks_and_sends_the_token_named_by_rewards_remote_token_env(monkeypatch):
    """Refused before any model loads, naming the key: the variable unset or empty, a token the
    server does not take, none where it wants one. Then a batch over the server's limits is a
    clean stop naming the limit."""
    app = build_app([ConstantScorer(["helpful"], 0.25)], token=TOKEN, limits=Limits(max_items=2))
    batch = ScoringBatch([i.prompt for i in ITEMS[:2]], [i.response for i in ITEMS[:2]], [4, 4], [{}, {}])
    key = "'rewards.remote.token_env': "
    with in_thread(app) as url:

        def components(token_env: str | None) -> RewardComponents:
            remote = {"url": url, "components": {"helpful": 1.0}, "token_env": token_env, "retries": 0}
            return RewardComponents(RewardsSection.model_validate({"remote": remote}), max_new_tokens=16)

        no_token = "the environment variable RM_TOKEN holds no token for the reward server: "
        for value, token_env, said in (
            (None, "RM_TOKEN", no_token + "it is not set"),
            ("", "RM_TOKEN", no_token + "it is empty"),
            ("wrong", "RM_TOKEN", rf"reward server {url}/v1/components refused the request: HTTP 401: no valid"),
            (TOKEN, None, r"reward server .* HTTP 401: no valid token: .*\(the server wants a token\)"),
        ):
            if value is None:
                monkeypatch.delenv("RM_TOKEN", raising=False)
            else:
                monkeypatch.setenv("RM_TOKEN", value)
            refused = components(token_env)
            with pytest.raises(RewardsConfigError, match=key + said):
                refused.check()
            refused.close()
        monkeypatch.setenv("RM_TOKEN", TOKEN)
        accepted = components("RM_TOKEN")
        try:
            accepted.check()
            assert accepted.score(batch)["remote_helpful"].values.tolist() == [0.25, 0.25]
            four = ScoringBatch(batch.prompts * 2, batch.responses * 2, [4] * 4, [{}] * 4)
            with pytest.raises(RewardsUnavailable, match="HTTP 422: 4 items, more than the server's --max-items 2"):
                accepted.score(four)
        finally:
            accepted.close()
    with pytest.raises(ValueError, match="token_env '' names no environment variable"):
        RewardsSection.model_validate({"remote": {"url": "http://127.0.0.1:1", "components": {}, "token_env": ""}})
