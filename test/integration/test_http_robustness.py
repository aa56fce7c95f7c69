"""Bad input over HTTP, on a `radixlm serve` with --api-key and --admin-api-key: the inputs that
used to crash or hang the server (each sent while other streams run, which must finish),
typed 400s, limits (body size, slow clients, n, logprobs, weights, client chat templates),
authentication (raw HTTP and the official openai client) and browser-origin checks."""
from __future__ import annotations

import socket
import threading
import time

import httpx
import openai
import pytest

from test.support.server import ServerProcess, assert_idle, serving, sse_events

USER, ADMIN = "user-key", "admin-key"
U = {"Authorization": f"Bearer {USER}"}
A = {"Authorization": f"Bearer {ADMIN}"}
EXTRA = ("--api-key", USER, "--admin-api-key", ADMIN, "--allow-client-chat-template", "--chat-template-timeout", "2",
         "--http-header-timeout", "2", "--http-body-timeout", "3", "--max-payload-size", str(1 << 20))


class KeyedServer(ServerProcess):
    def info(self) -> dict:
        return httpx.get(self.base + "/get_server_info", headers=A, timeout=10.0).json()


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    with serving(tiny_llama_dir, str(tmp_path_factory.mktemp("robust") / "server.log"), *EXTRA,
                 cls=KeyedServer) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base, timeout=60.0, headers=U) as c:
        yield c


def _deep_schema(levels: int) -> str:
    """A JSON schema whose objects nest `levels` deep, as JSON text (Python's json module
    cannot even encode 900 levels)."""
    return '{"type":"object","properties":{"a":' * (levels // 2) + '{"type":"object"}' + "}}" * (levels // 2)


# (path, body, expected status): inputs that once crashed or hung it, then typed 400s
HOSTILE = [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "top_p": 1e-300}, 200),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "top_p": 1e-40, "temperature": 1.0, "top_k": 5}, 200),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "logit_bias": {"1": 3.5e38}}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                              "logit_bias": {"1": 3.5e38}, "temperature": 1.0}, 400),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "logit_bias": {"1": 100}, "temperature": 1.0}, 200),
    ("/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 4, "seed": 1.5}}, 400),
    ("/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 4, "seed": "abc"}}, 400),
    ("/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 4, "seed": [1]}}, 400),
    ("/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 4, "skip_special_tokens": "no"}}, 400),
    ("/generate", {"text": "Hello", "stream": True, "sampling_params": {"skip_special_tokens": "no"}}, 400),
    ("/generate", {"text": "Hi", "sampling_params": {"temperature": "hot"}}, 400),
    ("/generate", {"text": "Hi", "sampling_params": {"top_k": "5"}}, 400),
    ("/generate", {"text": "Hi", "sampling_params": {"stop": 5}}, 400),
    ("/generate", {"text": "Hi", "sampling_params": {"logit_bias": [1]}}, 400),
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "temperature": None,
                                                     "frequency_penalty": None}}, 200),
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 3000}}, 400),
    ("/generate", ('{"text": "Hi", "sampling_params": {"max_new_tokens": 2, "json_schema": %s}}'
                   % _deep_schema(80)).encode(), 400),
    ("/v1/chat/completions", ('{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "response_format": '
                              '{"type": "json_schema", "json_schema": {"name": "d", "schema": %s}}}'
                              % _deep_schema(900)).encode(), 400),
    ("/generate", ('{"text": "Hi", "sampling_params": {"max_new_tokens": 2, "json_schema": "%s"}}'
                   % _deep_schema(900).replace('"', '\\"')).encode(), 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1, "n": 1000}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1, "logprobs": 50}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "logprobs": True,
                              "top_logprobs": 21}, 400),
    ("/generate", {"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": 10 ** 6}, 400),
    ("/generate", {"input_ids": {"a": 1}}, 400),
    ("/generate", {"text": ["a"] * 3, "sampling_params": {"n": 4000, "max_new_tokens": 1}}, 400),
]


def _stream(server, i: int, out: dict) -> None:
    body = {"input_ids": [5, 6, 7 + i], "stream": True,
            "sampling_params": {"max_new_tokens": 48, "ignore_eos": True, "temperature": 0}}
    with httpx.stream("POST", server.base + "/generate", json=body, headers=U, timeout=120.0) as r:
        out[i] = (r.status_code, sse_events(r.iter_lines()))


def test_hostile_inputs_while_other_streams_run(server, http):
    streams: dict = {}
    threads = [threading.Thread(target=_stream, args=(server, i, streams)) for i in range(5)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while server.info()["num_running_reqs"] < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    for path, body, status in HOSTILE:
        if isinstance(body, bytes):
            r = http.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = http.post(path, json=body)
        assert r.status_code == status, (path, body, r.text)
        if status == 400:
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == 400 and err["message"]
        assert http.get("/health").status_code == 200
    for t in threads:
        t.join(120)
    for i in range(5):
        status, events = streams[i]
        assert status == 200 and events[-1] == "[DONE]", events[-3:]
        assert len(events[-2]["output_ids"]) == 48 and events[-2]["meta_info"]["finish_reason"]["type"] == "length"
    ok = http.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 48,
                                                                               "ignore_eos": True, "temperature": 0}})
    assert ok.json()["output_ids"] == streams[0][1][-2]["output_ids"]
    assert_idle(server, within=60.0)
    assert "Traceback" not in server.log()


def test_openapi_declares_the_request_bodies(http):
    spec = http.get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/generate", "/pause_generation"):
        assert "$ref" in spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    sp = spec["components"]["schemas"]["SamplingParamsInput"]["properties"]
    assert sp["top_p"]["anyOf"][0] == {"exclusiveMinimum": 0.0, "maximum": 1.0, "type": "number"}


# ---------------------------------------------------------------------------- limits
def test_body_size_limit(server, http):
    big = b'{"text": "' + b"a" * (1 << 20) + b'"}'
    r = http.post("/generate", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413

    def chunks():
        yield b'{"text": "'
        for _ in range(40):
            yield b"a" * 32768
        yield b'"}'
    r = http.post("/generate", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413


def _connect(server) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port))
    s.settimeout(15)
    return s


def test_slow_headers_and_slow_bodies_are_cut_off(server, http):
    s = _connect(server)
    t0 = time.monotonic()
    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finishes its headers
    assert s.recv(100) == b"" and time.monotonic() - t0 < 12
    s.close()
    s = _connect(server)
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer user-key\r\n"
              b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"te")
    assert s.recv(200).startswith(b"HTTP/1.1 408")
    s.close()
    assert http.get("/health").status_code == 200


def test_weights_response_limit(http):
    r = http.post("/get_weights_by_name", headers=A, json={"name": "model.embed_tokens.weight", "truncate_size": 10 ** 6})
    assert r.status_code == 400 and "max-weights-response-elements" in r.json()["error"]["message"]
    assert len(http.post("/get_weights_by_name", headers=A, json={"name": "model.embed_tokens.weight",
                                                                  "truncate_size": 2}).json()) == 2


def test_client_chat_template_renders_with_a_time_limit(http):
    msgs = [{"role": "user", "content": "hi"}]
    own = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    r = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "temperature": 0,
                                                "chat_template_kwargs": {"chat_template": own}})
    default = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and default.status_code == 200
    assert r.json()["usage"]["prompt_tokens"] != default.json()["usage"]["prompt_tokens"]
    runaway = "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}"
    done: dict = {}

    def render() -> None:
        t0 = time.monotonic()
        done["r"] = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2,
                                                            "chat_template_kwargs": {"chat_template": runaway}})
        done["s"] = time.monotonic() - t0
    t = threading.Thread(target=render)
    t.start()
    time.sleep(0.3)
    assert http.get("/health", timeout=5.0).status_code == 200  # the event loop is free meanwhile
    t.join(60)
    assert done["r"].status_code == 400 and "did not render" in done["r"].json()["error"]["message"]
    r = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2,
                                                "chat_template_kwargs": {"tokenize": True}})
    assert r.status_code == 400 and "may not set tokenize" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2,
                                                "chat_template_kwargs": {"chat_template": own}})
    assert r.status_code == 200  # a fresh worker after the killed one


# ---------------------------------------------------------------------------- auth
def test_api_key_with_the_openai_client(server):
    good = openai.OpenAI(base_url=server.base + "/v1", api_key=USER, max_retries=0, timeout=60.0)
    out = good.completions.create(model="tiny_llama", prompt="Hi", max_tokens=2)
    assert out.usage.completion_tokens == 2
    assert [m.id for m in good.models.list().data] == ["tiny_llama"]
    admin = openai.OpenAI(base_url=server.base + "/v1", api_key=ADMIN, max_retries=0, timeout=60.0)
    assert admin.completions.create(model="tiny_llama", prompt="Hi", max_tokens=1).usage.completion_tokens == 1
    bad = openai.OpenAI(base_url=server.base + "/v1", api_key="wrong", max_retries=0, timeout=60.0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="tiny_llama", messages=[{"role": "user", "content": "x"}], max_tokens=1)


def test_keys_over_raw_http(server):
    base = server.base
    r = httpx.post(base + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.post(base + "/generate", headers={"x-api-key": USER},
                      json={"text": "x", "sampling_params": {"max_new_tokens": 1}}).status_code == 200
    for path in ("/health", "/health_generate", "/metrics"):  # probes and scrapers need no key
        assert httpx.get(base + path, timeout=30.0).status_code == 200
    # control routes take the admin key only
    for path, body in (("/pause_generation", {"mode": "in_place"}), ("/continue_generation", None),
                       ("/flush_cache", None), ("/update_weight_version", {"new_version": "v9"}),
                       ("/abort_request", {"rid": "nobody"}), ("/release_memory_occupation", None)):
        assert httpx.post(base + path, json=body).status_code == 401, path
        assert httpx.post(base + path, json=body, headers=U).status_code == 401, path
    assert httpx.post(base + "/pause_generation", json={"mode": "in_place"}, headers=A).status_code == 200
    assert httpx.post(base + "/continue_generation", headers=A).status_code == 200
    assert httpx.post(base + "/update_weight_version", json={"new_version": "v9"}, headers=A).status_code == 200
    assert httpx.get(base + "/get_weight_version", headers=U).json()["weight_version"] == "v9"


def test_server_info_hides_paths_and_pids_from_non_admins(server):
    user = httpx.get(server.base + "/get_server_info", headers=U).json()
    assert "runtime" not in user and user["server_args"]["model_path"] is None and "model_path" not in user
    assert user["server_args"]["api_key"] == "<set>" and user["server_args"]["admin_api_key"] == "<set>"
    admin = server.info()
    assert admin["runtime"]["child_pids"] and admin["server_args"]["model_path"]
    assert USER not in str(admin) and ADMIN not in str(admin)


def test_weight_load_errors_are_detailed_for_the_admin(server):
    r = httpx.post(server.base + "/update_weights_from_disk", json={"model_path": "/nonexistent"}, headers=A)
    assert r.status_code == 400 and "does not exist" in r.json()["error"]["message"]


@pytest.mark.parametrize("headers", [
    {"Origin": "http://evil.example"},  # a page elsewhere POSTing a "simple" request
    {"Origin": "null"},
    {"Sec-Fetch-Site": "cross-site"},
    {"Sec-Fetch-Site": "same-site"},  # another port on localhost
])
def test_cross_origin_browser_requests_cannot_change_state(server, headers):
    for path, kw in (("/pause_generation", {"content": b"mode=abort",
                                            "headers": {"content-type": "application/x-www-form-urlencoded"}}),
                     ("/generate", {"json": {"text": "x"}})):
        h = {**A, **headers, **kw.pop("headers", {})}
        r = httpx.post(server.base + path, headers=h, **kw)
        assert r.status_code == 403, (path, headers, r.text)
    r = httpx.get(server.base + "/flush_cache", headers={**A, **headers})
    assert r.status_code == 403
    assert server.info()["paused"] is False
    same = httpx.post(server.base + "/generate", headers={**U, "Origin": server.base},
                      json={"text": "x", "sampling_params": {"max_new_tokens": 1}})
    assert same.status_code == 200  # the server's own origin is fine


def test_dns_rebinding_host_is_refused(server):
    browser = {**U, "Sec-Fetch-Site": "same-origin"}  # a page served from evil.example, rebound to 127.0.0.1
    r = httpx.get(server.base + "/get_model_info", headers={**browser, "Host": f"evil.example:{server.port}"})
    assert r.status_code == 403
    assert httpx.get(f"http://localhost:{server.port}/get_model_info", headers=browser).status_code == 200
    # not a browser: a raw client may send any Host
    assert httpx.get(server.base + "/get_model_info", headers={**U, "Host": "x"}).status_code == 200
