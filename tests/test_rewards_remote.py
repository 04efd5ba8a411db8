"""The remote reward against a real HTTP server (http.server in a thread): rewards and
fields on the wire, concurrent requests, counted retries, and one-line errors for a server
that hangs, answers garbage or refuses; never a hang."""

import gzip
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_grpo.config.base import ConfigError, build_section
from megatron_grpo.config.sections import RewardConfig
from megatron_grpo.rewards import RewardError, RewardSample, RewardScorer


BOMB = gzip.compress(b"0" * 20_000_000)


class Server:
    """Routes: /score (reward = len(response_ids) + row.bonus), /pair (each request waits
    until two are in flight), /hang (never answers in time), /badjson, /flaky (503 on every
    first try), /denied (HTTP 400), /auth (401 unless the bearer key is right)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.seen: list[dict] = []
        self.tries: dict[str, int] = {}
        self.pair = threading.Barrier(2, timeout=5)
        self.release = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.seen.append(body)
                    tries = server.tries[body["response"]] = server.tries.get(body["response"], 0) + 1
                route = self.path
                if route == "/hang":
                    server.release.wait(30)
                    return self.reply(200, b'{"reward": 1}')
                if route == "/pair":
                    try:
                        server.pair.wait(timeout=2)
                    except threading.BrokenBarrierError:  # the two requests did not overlap
                        return self.reply(500, b"alone")
                if route == "/badjson":
                    return self.reply(200, b"<html>oops</html>")
                if route == "/pastfloat":  # a JSON integer no float holds
                    return self.reply(200, b'{"reward": 1' + b"0" * 400 + b"}")
                if route == "/huge":  # 2 MiB, its length declared
                    return self.reply(200, b" " * (2 << 20))
                if route == "/gzipbomb":  # 20 KB on the wire, 20 MB once decompressed
                    return self.reply(200, BOMB, {"Content-Encoding": "gzip"})
                if route == "/trickle":  # no Content-Length: 2 MiB in chunks until the connection closes
                    self.send_response(200)
                    self.send_header("Connection", "close")
                    self.end_headers()
                    try:
                        for _ in range(32):
                            self.wfile.write(b" " * (64 << 10))
                    except (ConnectionResetError, BrokenPipeError):
                        pass  # the client stopped reading past its bound, as it must (not a traceback in the log)
                    return None
                if route == "/flaky" and tries == 1:
                    return self.reply(503, b"busy")
                if route == "/denied":
                    return self.reply(400, b"no such task\nsecond line")
                if route == "/auth" and self.headers.get("Authorization") != "Bearer s3cret":
                    return self.reply(401, b"bad key")
                reward = len(body["response_ids"]) + body["row"].get("bonus", 0)
                return self.reply(200, json.dumps({"reward": reward}).encode())

            def reply(self, code, payload, headers=None):
                self.send_response(code)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.close()


def remote(url, **kw):
    max_concurrency = kw.pop("max_concurrency", 32)
    cfg = build_section(RewardConfig, {"functions": [{"name": "remote", "max_concurrency": max_concurrency,
                                                      "remote": {"url": url, **kw}}]}, "reward")
    return RewardScorer(cfg)


def samples(*responses, bonus=0):
    return [RewardSample(prompt="p", response=r, answer="a", response_ids=list(range(len(r))), prompt_ids=[1],
                         finish_reason="stop", row={"bonus": bonus}) for r in responses]


def test_rewards_and_the_sample_on_the_wire(server):
    s = remote(server.url + "/score")
    out = s.score_samples(samples("abc", "de", bonus=10))
    s.close()
    assert out.rewards == [13.0, 12.0] and out.stats == {"remote/retries": 0.0}
    sent = next(b for b in server.seen if b["response"] == "abc")
    assert sent == {"prompt": "p", "response": "abc", "answer": "a", "response_ids": [0, 1, 2], "prompt_ids": [1],
                    "finish_reason": "stop", "row": {"bonus": 10}}


def test_requests_overlap_up_to_max_concurrency(server):
    assert remote(server.url + "/pair", max_concurrency=2).score_samples(samples("p1", "p2")).rewards == [2.0, 2.0]
    # one at a time, the server's pair barrier breaks (HTTP 500, retried, and fails again)
    server.pair.reset()
    with pytest.raises(RewardError, match="HTTP 500 after 1 attempt"):
        remote(server.url + "/pair", max_concurrency=1, max_retries=0, timeout_s=10).score_samples(samples("q1", "q2"))
    server.pair.reset()


def test_retries_are_counted(server):
    out = remote(server.url + "/flaky", max_retries=2).score_samples(samples("f1", "f22", "f333"))
    assert out.rewards == [2.0, 3.0, 4.0] and out.stats == {"remote/retries": 3.0}
    assert [server.tries[r] for r in ("f1", "f22", "f333")] == [2, 2, 2]


def test_a_hanging_server_is_a_bounded_one_line_error(server):
    t0 = time.monotonic()
    with pytest.raises(RewardError) as e:
        remote(server.url + "/hang", timeout_s=0.5, max_retries=1).score_samples(samples("h"))
    assert time.monotonic() - t0 < 10
    assert str(e.value) == (f"reward.functions[0] (remote) raised on sample 0: RemoteRewardFailure: {server.url}/hang: "
                            "no answer within timeout_s=0.5 after 2 attempt(s) (remote.max_retries=1)")


@pytest.mark.parametrize("route, expected", [
    ("/badjson", "the answer is not JSON: '<html>oops</html>'; expected {\"reward\": <number>}"),
    ("/denied", "HTTP 400: no such task second line"),
    ("/auth", "HTTP 401: bad key"),
    ("/huge", "the answer is too large (Content-Length 2097152; the limit is 1048576 bytes); "
              "expected {\"reward\": <number>}"),
    ("/gzipbomb", "the answer is too large (once decompressed; the limit is 1048576 bytes); "
                  "expected {\"reward\": <number>}"),
    ("/trickle", "the answer is too large (as sent; the limit is 1048576 bytes); expected {\"reward\": <number>}"),
    # issue 48, round 2: was "OverflowError: int too large to convert to float", naming neither URL nor answer
    ("/pastfloat", "expected {\"reward\": <finite number>}, got {\"reward\": 1" + "0" * 68),
])
def test_bad_answers_fail_at_once(server, route, expected):
    with pytest.raises(RewardError) as e:
        remote(server.url + route, max_retries=3).score_samples(samples(f"x{route}"))
    assert str(e.value) == f"reward.functions[0] (remote) raised on sample 0: RemoteRewardFailure: {server.url}{route}: {expected}"
    assert server.tries[f"x{route}"] == 1  # not retried


def test_unreachable_server(server):
    with pytest.raises(RewardError, match=r"ConnectError: .* after 2 attempt\(s\)"):
        remote("http://127.0.0.1:9/score", max_retries=1).score_samples(samples("u"))


def test_api_key_from_the_environment(server, monkeypatch):
    monkeypatch.setenv("VERIFIER_KEY", "s3cret")
    assert remote(server.url + "/auth", api_key_env="VERIFIER_KEY").score_samples(samples("k")).rewards == [1.0]
    monkeypatch.delenv("VERIFIER_KEY")
    with pytest.raises(ConfigError) as e:
        remote(server.url + "/auth", api_key_env="VERIFIER_KEY")
    assert str(e.value) == "reward.functions[0].remote.api_key_env: environment variable VERIFIER_KEY is not set (or empty)"


@pytest.mark.parametrize("fn, expected", [
    ({"name": "remote"}, "reward.functions[0].remote: is required for a remote reward (url, timeout_s, ...)"),
    ({"name": "format", "remote": {"url": "http://x"}}, "reward.functions[0].remote: is only for name: remote "
                                                        "(this function is 'format')"),
    ({"name": "remote", "remote": {"url": "x:80"}}, "reward.functions[0].remote.url: must start with http:// or "
                                                    "https://, got 'x:80'"),
    ({"name": "remote", "remote": {"url": "http://x", "timeout": 3}},
     "reward.functions[0].remote.timeout: unknown key; did you mean 'timeout_s'?"),
    ({"name": "remote", "remote": {"url": "http://x"}, "kwargs": {"a": 1}},
     "reward.functions[0].kwargs: a remote reward takes no kwargs (its server gets the whole sample)"),
])
def test_config_errors(fn, expected):
    with pytest.raises(ConfigError) as e:
        build_section(RewardConfig, {"functions": [fn]}, "reward")
    assert str(e.value) == expected
