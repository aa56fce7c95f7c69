"""Normalizing a generate call (single or batch, text or ids, n > 1) into scheduler requests.

All validation happens here (with the rules of radixlm/validation.py), before anything is
submitted, so a bad item raises ValueError and nobody else's request is touched.
"""
from __future__ import annotations

import copy
import dataclasses
import uuid
from dataclasses import dataclass
from typing import Any

from radixlm.messages import SessionParams, TokenizedGenerateReq
from radixlm.sampling_params import SamplingParams
from radixlm.srt.sglang_fields import check_sglang_fields
from radixlm.srt.text_bound import check_text_length
from radixlm.validation import RequestLimits, check_context, check_top_logprobs_num


# token_ids_logprob: the most ids one request may ask about (each logprob position reports them all)
MAX_TOKEN_IDS_LOGPROB = 1024


@dataclass
class GenerateItem:
    """One user-visible request (before n > 1 expansion)."""
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    stream: bool
    timeout: float | None = None
    bootstrap: tuple[str, int, int] | None = None  # disaggregation: (host, port, room)
    # The caller's prefix-cache namespace (extra_key and cache_salt); the tokenizer manager
    # puts it under the weights' namespace.
    cache_key: str | None = None
    token_ids_logprob: tuple[int, ...] = ()  # ids whose logprobs each logprob position reports
    priority: int | None = None  # None: the server's default (used with --enable-priority-scheduling)
    session: SessionParams | None = None  # a turn of an open session (/open_session)

    def expand(self) -> list[TokenizedGenerateReq]:
        n = self.sampling_params.n
        if n == 1:
            return [self._req(self.rid, self.sampling_params, 0)]
        out = []
        for i in range(n):
            sp = copy.deepcopy(self.sampling_params)
            sp.n = 1
            if sp.seed is not None:
                sp.seed = sp.seed + i  # identical seeds would give identical children
            out.append(self._req(f"{self.rid}_{i}", sp, i))
        return out

    def _req(self, rid: str, sp: SamplingParams, index: int) -> TokenizedGenerateReq:
        # the gateway gives one room per request whatever its n: child i's KV is (room, i)'s
        bootstrap = (*self.bootstrap, index) if self.bootstrap is not None else None
        return TokenizedGenerateReq(rid=rid, input_ids=self.input_ids, sampling_params=sp,
                                    return_logprob=self.return_logprob,
                                    top_logprobs_num=self.top_logprobs_num,
                                    logprob_start_len=self.logprob_start_len, stream=self.stream,
                                    timeout=self.timeout, bootstrap=bootstrap, extra_key=self.cache_key,
                                    token_ids_logprob=self.token_ids_logprob, priority=self.priority,
                                    session=dataclasses.replace(self.session, turn=rid) if self.session else None)


def _as_list(x: Any, n: int, name: str) -> list:
    if isinstance(x, list):
        if len(x) != n:
            raise ValueError(f"{name} has {len(x)} entries but there are {n} prompts")
        return x
    return [x] * n


def _explicit_max_new_tokens(sp: Any) -> bool:
    """Whether the caller chose max_new_tokens (checked against the context) or left the
    default (clamped to the room the prompt leaves, as SGLang does)."""
    if isinstance(sp, SamplingParams):
        return True
    return isinstance(sp, dict) and any(sp.get(k) is not None for k in ("max_new_tokens", "max_tokens"))


def _sampling_params(raw: Any, vocab_size: int, limits: RequestLimits) -> SamplingParams:
    if isinstance(raw, SamplingParams):
        sp = copy.deepcopy(raw)
    elif raw is None or isinstance(raw, dict):
        sp = SamplingParams.from_dict(raw)
    else:
        raise ValueError(f"sampling_params must be an object, got {type(raw).__name__}")
    sp.verify(vocab_size, limits)
    return sp


def _bootstraps(host: Any, port: Any, room: Any, n: int) -> list[tuple[str, int, int] | None]:
    """The gateway's bootstrap_host/port/room (one each, or a list per prompt of a batch)."""
    if room is None:
        if host is not None or port is not None:
            raise ValueError("bootstrap_host and bootstrap_port need a bootstrap_room")
        return [None] * n
    hosts, ports, rooms = (_as_list(host, n, "bootstrap_host"), _as_list(port, n, "bootstrap_port"),
                           _as_list(room, n, "bootstrap_room"))
    out: list[tuple[str, int, int] | None] = []
    for h, p, r in zip(hosts, ports, rooms, strict=True):
        if not isinstance(h, str) or not h:
            raise ValueError(f"bootstrap_host must be a host name, got {h!r}")
        if not isinstance(p, int) or isinstance(p, bool) or not 0 < p < 65536:
            raise ValueError(f"bootstrap_port must be a port number, got {p!r}")
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < 2**63:
            raise ValueError(f"bootstrap_room must be an integer in [0, 2^63), got {r!r}")
        out.append((h, p, r))
    return out


def _cache_keys(extra_key: Any, cache_salt: Any, n: int) -> list[str | None]:
    """SGLang's extra_key and cache_salt (one each, or a list per prompt): requests share cached
    prefixes only when both agree. An empty string is no key."""
    parts: list[list[str]] = [[] for _ in range(n)]
    for name, value in (("extra_key", extra_key), ("cache_salt", cache_salt)):
        if value is None:
            continue
        for i, v in enumerate(_as_list(value, n, name)):
            if not isinstance(v, str):
                raise ValueError(f"{name} must be a string (or a list of strings, one per prompt), got {v!r}")
            if v:
                parts[i].append(f"{name}={v}")
    return ["&".join(p) or None for p in parts]


def _check_stream_options(opts: Any) -> None:
    """/generate's chunks always carry prompt_tokens and completion_tokens (the usage so far), so
    both of OpenAI's options are satisfied; only their shape is checked."""
    if opts is None:
        return
    if not isinstance(opts, dict):
        raise ValueError(f"stream_options must be an object, got {type(opts).__name__}")
    for k, v in opts.items():
        if k not in ("include_usage", "continuous_usage_stats"):
            raise ValueError(f"stream_options.{k}: unknown field")
        if v is not None and not isinstance(v, bool):
            raise ValueError(f"stream_options.{k} must be a boolean, got {v!r}")


def _token_ids_logprob(value: Any, n: int, vocab_size: int) -> list[tuple[int, ...]]:
    """SGLang's token_ids_logprob: one list of ids for every prompt, or a list per prompt."""
    if value is None:
        return [()] * n
    if not isinstance(value, list):
        raise ValueError(f"token_ids_logprob must be a list of token ids, got {type(value).__name__}")
    per_prompt = bool(value) and all(isinstance(v, list) for v in value)
    lists = _as_list(value, n, "token_ids_logprob") if per_prompt else [value] * n
    out = []
    for ids in lists:
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("token_ids_logprob must be a list of token ids (or one list per prompt)")
        if len(ids) > MAX_TOKEN_IDS_LOGPROB:
            raise ValueError(f"token_ids_logprob has {len(ids)} ids, more than the limit of {MAX_TOKEN_IDS_LOGPROB}")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token_ids_logprob out of the vocabulary range [0, {vocab_size}): {bad[:5]}")
        out.append(tuple(ids))
    return out


def _session_params(raw: Any) -> SessionParams | None:
    """SGLang's session_params: {id, rid, offset, replace, drop_previous_output}."""
    if raw is None or isinstance(raw, SessionParams):
        return raw
    if not isinstance(raw, dict):
        raise ValueError(f"session_params must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - {"id", "rid", "offset", "replace", "drop_previous_output"})
    if unknown:
        raise ValueError(f"session_params: unknown field(s) {', '.join(unknown)}")
    sid, rid, offset = raw.get("id"), raw.get("rid"), raw.get("offset")
    if not isinstance(sid, str) or not sid:
        raise ValueError("session_params.id must be a session id (from /open_session)")
    if rid is not None and (not isinstance(rid, str) or not rid):
        raise ValueError("session_params.rid must be the rid of a turn of the session")
    if offset is not None and (not isinstance(offset, int) or isinstance(offset, bool) or offset < 0):
        raise ValueError(f"session_params.offset must be a non-negative integer, got {offset!r}")
    for flag in ("replace", "drop_previous_output"):
        if raw.get(flag) is not None:
            _check_flag(raw[flag], f"session_params.{flag}")
    return SessionParams(sid, rid, offset, bool(raw.get("replace")), bool(raw.get("drop_previous_output")))


def _check_flag(value: Any, name: str) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a boolean, got {value!r}")


def normalize_generate(tokenizer, *, vocab_size: int, context_len: int, limits: RequestLimits | None = None,
                       prompt=None, input_ids=None, sampling_params=None, return_logprob=False,
                       logprob_start_len=None, top_logprobs_num=None, rid=None,
                       stream: bool = False, timeout: float | None = None, bootstrap_host=None,
                       bootstrap_port=None, bootstrap_room=None, extra_key=None, cache_salt=None,
                       stream_options=None, token_ids_logprob=None, priority=None, session_params=None,
                       **sglang_fields: Any) -> tuple[list[GenerateItem], bool]:
    """Returns the items and whether the call was a batch. `sglang_fields`: SGLang's other
    GenerateReqInput fields, accepted at their neutral values (sglang_fields.py)."""
    limits = limits or RequestLimits()
    check_sglang_fields(sglang_fields)
    _check_stream_options(stream_options)
    if (prompt is None) == (input_ids is None):
        raise ValueError("exactly one of prompt and input_ids must be given")
    if prompt is not None:
        is_batch = isinstance(prompt, list)
        texts = prompt if is_batch else [prompt]
        if not texts:
            raise ValueError("the prompt list is empty")
        for t in texts:
            if not isinstance(t, str):
                raise ValueError(f"a prompt must be a string, got {type(t).__name__}")
            if not t:
                raise ValueError("the prompt is empty")
            if tokenizer is None:
                raise ValueError("text prompts need a tokenizer, and this server runs with "
                                 "skip_tokenizer_init: send input_ids")
            check_text_length(tokenizer, len(t), context_len)  # before the costly tokenizing
        n = len(texts)
    else:
        if not isinstance(input_ids, list):
            raise ValueError("input_ids must be a list of token ids or a list of such lists")
        is_batch = bool(input_ids) and isinstance(input_ids[0], list)
        n = len(input_ids) if is_batch else 1
    _check_flag(stream, "stream")
    if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool)
                                or not 0 < timeout < float("inf")):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if is_batch and stream:
        raise ValueError("stream=True takes a single prompt")
    sps = _as_list(sampling_params, n, "sampling_params")
    rlp = _as_list(return_logprob, n, "return_logprob")
    lsl = _as_list(logprob_start_len, n, "logprob_start_len")
    tln = _as_list(top_logprobs_num, n, "top_logprobs_num")
    boots = _bootstraps(bootstrap_host, bootstrap_port, bootstrap_room, n)
    cache_keys = _cache_keys(extra_key, cache_salt, n)
    asked = _token_ids_logprob(token_ids_logprob, n, vocab_size)
    prios = _as_list(priority, n, "priority")
    session = _session_params(session_params)
    if session is not None and is_batch:
        raise ValueError("session_params takes a single prompt")
    for p in prios:
        if p is not None and (not isinstance(p, int) or isinstance(p, bool)):
            raise ValueError(f"priority must be an integer, got {p!r}")
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(n)]
    else:
        rids = _as_list(rid, n, "rid") if is_batch else [rid]
        if not all(isinstance(r, str) and r for r in rids):
            raise ValueError("rid must be a non-empty string")
        if len(set(rids)) != len(rids):
            raise ValueError("rids within one call must be distinct")

    params = [_sampling_params(sp, vocab_size, limits) for sp in sps]
    if prompt is not None:  # the costly part, once the cheap checks passed
        ids_list = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    else:
        ids_list = input_ids if is_batch else [input_ids]
    items = []
    total = 0
    for i, ids in enumerate(ids_list):
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                for t in ids):
            raise ValueError("input_ids must be a list of integers")
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"input token ids out of the vocabulary range [0, {vocab_size}): {bad[:5]}")
        sp = params[i]
        check_context(len(ids), sp.max_new_tokens if _explicit_max_new_tokens(sps[i]) else None, context_len)
        if tokenizer is None and (sp.stop or sp.stop_regex or sp.grammar is not None):
            raise ValueError("stop strings, stop_regex and structured output need a tokenizer, and this "
                             "server runs with skip_tokenizer_init (stop_token_ids work)")
        _check_flag(rlp[i], "return_logprob")
        start = lsl[i]
        if start is not None and (not isinstance(start, int) or isinstance(start, bool)):
            raise ValueError(f"logprob_start_len must be an integer, got {start!r}")
        start = -1 if start is None else start
        if rlp[i] and start < 0:
            start = len(ids)  # default: output logprobs only
        if start > len(ids):
            raise ValueError(f"logprob_start_len ({start}) exceeds the prompt length ({len(ids)})")
        top = 0 if tln[i] is None else tln[i]
        check_top_logprobs_num(top, limits)
        if asked[i] and not rlp[i]:
            raise ValueError("token_ids_logprob needs return_logprob=true")
        total += sp.n
        if total > limits.max_sequences_per_request:
            raise ValueError(f"the call asks for more than {limits.max_sequences_per_request} sequences "
                             "(prompts x n; server flag --max-sequences-per-request)")
        if session is not None and sp.n != 1:
            raise ValueError("session_params takes n = 1")
        items.append(GenerateItem(rids[i], list(ids), sp, bool(rlp[i]), start, top, stream, timeout, boots[i],
                                  cache_keys[i], asked[i], prios[i], session))
    return items, is_batch
