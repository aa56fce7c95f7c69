"""Property-based fuzzing of the HTTP routes over their OpenAPI schema.

Bodies are drawn from the request schemas the server publishes in /openapi.json (so the
schema itself is under test: a route without a declared body would not be fuzzed), with any
field replaced now and then by arbitrary JSON (wrong types, nulls, huge numbers, deep
nesting). The properties: no 5xx (a 503 is allowed only for a request's own timeout), every
error is an OpenAI-style JSON body, nothing hangs, and afterwards the server answers a good
request and holds no KV. Bounded in examples and in wall time (~1-2 minutes)."""
from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test.support.server import assert_idle, serving

# Routes fuzzed with a body. Those that change the server's state for everybody (pause,
# memory, weights) are left out: they work as designed, and the properties would not hold.
ROUTES = [("/v1/completions", 4), ("/v1/chat/completions", 4), ("/generate", 4), ("/abort_request", 1),
          ("/get_weights_by_name", 1), ("/update_weight_version", 1)]
WALL_BUDGET_S = 100.0
MAX_EXAMPLES = 160
# one field in JUNK_ODDS + 1 is arbitrary JSON instead of a value of its type
JUNK_ODDS = 12

JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(allow_nan=False,
                      allow_infinity=False), st.text(max_size=12))
JUNK = st.recursive(JSON_LEAF, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                    max_leaves=8)


def deep(levels: int):
    value: object = 1
    for _ in range(levels):
        value = [value]
    return value


def from_schema(schema: dict, components: dict, depth: int = 0) -> st.SearchStrategy:
    """Values valid for `schema` (the subset of JSON Schema pydantic emits), or now and then
    anything at all."""
    valid = _valid(schema, components, depth)
    return st.one_of(*[valid] * JUNK_ODDS, JUNK) if depth else valid


def _valid(schema: dict, comps: dict, depth: int) -> st.SearchStrategy:
    if "$ref" in schema:
        return _valid(comps[schema["$ref"].rsplit("/", 1)[-1]], comps, depth)
    if "anyOf" in schema:
        return st.one_of([_valid(s, comps, depth) for s in schema["anyOf"]])
    if "enum" in schema or "const" in schema:
        return st.sampled_from(schema.get("enum", [schema.get("const")]))
    kind = schema.get("type")
    if kind == "object" and "properties" in schema:
        props = {k: from_schema(v, comps, depth + 1) for k, v in schema["properties"].items()}
        required = {k: props.pop(k) for k in schema.get("required", []) if k in props}
        return st.fixed_dictionaries(required, optional=props)
    if kind == "object":
        return st.dictionaries(st.text(max_size=6), JUNK, max_size=3)
    if kind == "array":
        return st.lists(_valid(schema.get("items", {}), comps, depth + 1), max_size=4)
    if kind == "string":
        return st.text(max_size=24)
    if kind == "integer":
        lo = schema.get("minimum", schema.get("exclusiveMinimum", -10) + (1 if "exclusiveMinimum" in schema else 0))
        return st.integers(lo, schema.get("maximum", max(lo, 0) + 40))
    if kind == "number":
        return st.floats(schema.get("minimum", schema.get("exclusiveMinimum", -5.0)), schema.get("maximum", 5.0),
                         exclude_min="exclusiveMinimum" in schema, allow_nan=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return JUNK  # Any


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    with serving(tiny_llama_dir, str(tmp_path_factory.mktemp("fuzz") / "server.log"),
                 "--context-length", "128", "--max-n", "4", "--max-sequences-per-request", "16") as srv:
        yield srv


def _check_error(body: dict, status: int, sent: dict) -> None:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status and err["message"]
    if status >= 500:
        assert status == 503 and "timed out" in err["message"] and "timeout" in sent, (status, err, sent)


@pytest.mark.slow
def test_fuzz_routes_from_the_openapi_schema(server):
    spec = httpx.get(server.base + "/openapi.json").json()
    comps = spec["components"]["schemas"]
    bodies = []
    for path, weight in ROUTES:
        ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        bodies += [st.tuples(st.just(path), from_schema(ref, comps))] * weight
    # and a few hostile shapes for every route: nesting, wrong top-level types
    hostile = st.tuples(st.sampled_from([p for p, _ in ROUTES]),
                        st.one_of(st.builds(deep, st.integers(60, 900)), JUNK))
    start = time.monotonic()
    seen: dict[int, int] = {}

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=st.one_of(*bodies, hostile), stream=st.booleans())
    def run(case, stream):
        if time.monotonic() - start > WALL_BUDGET_S:
            return
        path, body = case
        if isinstance(body, dict) and path != "/abort_request" and "stream" not in body and stream:
            body = {**body, "stream": True}
        content = json.dumps(body).encode() if not isinstance(body, list) or len(str(body)) < 10_000 else \
            ("[" * 900 + "]" * 900).encode()
        with httpx.Client(base_url=server.base, timeout=60.0) as c:
            with c.stream("POST", path, content=content, headers={"content-type": "application/json"}) as r:
                raw = r.read()
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500 or r.status_code == 503, (path, body, r.status_code, raw[:300])
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
            assert events and events[-1] == "[DONE]", (path, body, raw[-300:])
            for e in events[:-1]:
                obj = json.loads(e)
                if "error" in obj:
                    _check_error(obj, obj["error"]["code"], body)
        elif r.status_code >= 400:
            _check_error(json.loads(raw), r.status_code, body)

    run()
    print(f"fuzz: {sum(seen.values())} requests in {time.monotonic() - start:.0f} s, statuses {seen}")
    # not vacuous: enough requests ran (whatever the machine's load), and both kinds of answer came
    assert sum(seen.values()) >= 20 and seen.get(200, 0) >= 1 and seen.get(400, 0) >= 1, seen
    ok = httpx.post(server.base + "/v1/completions", json={"prompt": "still fine", "max_tokens": 3}, timeout=60.0)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert httpx.get(server.base + "/health").status_code == 200
    httpx.post(server.base + "/abort_request", json={"abort_all": True})
    assert_idle(server, within=60.0)
    assert "Traceback" not in server.log(), server.log()[-3000:]
