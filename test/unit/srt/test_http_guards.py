"""The HTTP guards without a server: who may call which route (http_auth), browser-origin
checks, and chat-template rendering rules (chat_template)."""
from __future__ import annotations

import asyncio
import time

import pytest

from radixlm.srt.chat_template import ChatTemplateError, ChatTemplateRenderer
from radixlm.srt.http_auth import browser_refusal, decide, presented_key, route_level


@pytest.mark.parametrize("api,admin,level,key,allowed", [
    (None, None, "normal", None, True), (None, None, "admin", None, True),
    ("u", None, "normal", None, False), ("u", None, "normal", "u", True), ("u", None, "admin", "u", True),
    ("u", None, "admin", "x", False), ("u", "a", "normal", "u", True), ("u", "a", "normal", "a", True),
    ("u", "a", "admin", "u", False), ("u", "a", "admin", "a", True), (None, "a", "normal", None, True),
    (None, "a", "admin", None, False), (None, "a", "admin", "a", True), ("u", "a", "open", None, True),
])
def test_auth_decisions(api, admin, level, key, allowed):
    ok, info = decide(level, key, api, admin)
    assert ok is allowed
    # authenticated means a key was needed and given; admin means the control routes are open to it
    assert info.authenticated == ((admin or api) is not None and info.admin)


def test_route_levels_and_key_headers():
    assert route_level("/health") == route_level("/metrics") == "open"
    assert route_level("/pause_generation") == route_level("/update_weights_from_disk") == "admin"
    assert route_level("/generate") == route_level("/get_server_info") == "normal"
    assert presented_key({"authorization": "Bearer k1"}) == "k1"
    assert presented_key({"authorization": "bearer k1 "}) == "k1"
    assert presented_key({"x-api-key": "k2"}) == "k2"
    assert presented_key({"authorization": "Basic abc"}) is None


@pytest.mark.parametrize("method,level,headers,loopback,refused", [
    ("POST", "normal", {"host": "127.0.0.1:3", "origin": "http://evil.example"}, True, True),
    ("POST", "normal", {"host": "127.0.0.1:3", "origin": "http://127.0.0.1:3"}, True, False),
    ("POST", "admin", {"host": "localhost:3"}, True, False),  # curl, the openai client
    ("GET", "admin", {"host": "localhost:3", "sec-fetch-site": "cross-site"}, True, True),
    ("GET", "normal", {"host": "localhost:3", "sec-fetch-site": "cross-site"}, True, False),  # a read
    ("POST", "normal", {"host": "localhost:3", "sec-fetch-site": "same-origin"}, True, False),
    ("GET", "normal", {"host": "rebound.example:3", "sec-fetch-site": "same-origin"}, True, True),  # DNS rebinding
    ("GET", "normal", {"host": "x"}, True, False),  # not a browser (raw sockets, proxies' checks)
    ("GET", "normal", {"host": "[::1]:3", "sec-fetch-site": "same-origin"}, True, False),
    ("GET", "normal", {"host": "my.server:3"}, False, False),  # a public bind knows no host names
    ("POST", "normal", {"host": "my.server:3", "origin": "null"}, False, True),
])
def test_browser_refusals(method, level, headers, loopback, refused):
    assert (browser_refusal(method, level, headers, loopback) is not None) is refused


def test_allowed_hosts_behind_a_proxy():
    h = {"host": "llm.example.com", "origin": "https://llm.example.com", "sec-fetch-site": "same-origin"}
    assert browser_refusal("POST", "normal", h, True) is not None
    assert browser_refusal("POST", "normal", {**h, "origin": "http://llm.example.com"}, True, ("llm.example.com",)) \
        is None


MESSAGES = [{"role": "user", "content": "hi"}]


def _render(renderer, **kw):
    return asyncio.run(renderer.render(MESSAGES, add_generation_prompt=True, continue_final_message=False, **kw))


def test_model_template_and_its_variables(smollm2_tokenizer):
    r = ChatTemplateRenderer(smollm2_tokenizer)
    own = _render(r)
    assert own == smollm2_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert _render(r, client_kwargs={"enable_thinking": False}) == own  # a variable the template ignores
    for bad in ({"tokenize": True}, {"return_dict": True}, {"conversation": []}):
        with pytest.raises(ChatTemplateError, match="may not set"):
            _render(r, client_kwargs=bad)
    with pytest.raises(ChatTemplateError, match="allow-client-chat-template"):
        _render(r, client_kwargs={"chat_template": "{{ messages[0].content }}"})


def test_client_template_in_a_worker_with_a_time_limit(smollm2_tokenizer):
    r = ChatTemplateRenderer(smollm2_tokenizer, allow_client_template=True, timeout_s=2.0)

    async def run():
        try:
            text = await r.render(MESSAGES, add_generation_prompt=True, continue_final_message=False,
                                  client_kwargs={"chat_template": "{{ bos_token }}{{ messages[0].content }}!"})
            assert text == (smollm2_tokenizer.bos_token or "") + "hi!"
            with pytest.raises(ChatTemplateError, match="cannot apply"):
                await r.render(MESSAGES, add_generation_prompt=True, continue_final_message=False,
                               client_kwargs={"chat_template": "{{ raise_exception('no') }}"})
            t0 = time.monotonic()
            with pytest.raises(ChatTemplateError, match="did not render"):
                await r.render(MESSAGES, add_generation_prompt=True, continue_final_message=False,
                               client_kwargs={"chat_template": "{% for i in range(99999) %}{% for j in "
                                                               "range(99999) %}{{ j }}{% endfor %}{% endfor %}"})
            assert time.monotonic() - t0 < 10
            again = await r.render(MESSAGES, add_generation_prompt=True, continue_final_message=False,
                                   client_kwargs={"chat_template": "{{ messages[0].content }}"})
            assert again == "hi"  # a new worker replaced the killed one
        finally:
            await r.aclose()
    asyncio.run(run())
