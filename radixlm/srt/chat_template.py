"""Rendering chat templates without letting one request stall the server.

The model's own template renders in a worker thread (off the event loop; it is trusted
and fast). A request may pass template variables through `chat_template_kwargs`
(e.g. enable_thinking), but not arguments of apply_chat_template itself, and replacing the
template (`chat_template_kwargs.chat_template`) is refused unless the server runs with
--allow-client-chat-template. A client's template is arbitrary code for Jinja's sandbox
(which bounds ranges but not loops of loops), so it renders in a separate worker process
(`python -m radixlm.srt.chat_template`) with a time limit: past --chat-template-timeout the
worker is killed (a thread could not be stopped) and the request gets a 400; the next
client template starts a fresh worker.
"""
from __future__ import annotations

import asyncio
import json
import logging
import sys
from typing import Any

logger = logging.getLogger(__name__)

# apply_chat_template's own arguments: a request may not set them through the kwargs.
RESERVED_KWARGS = frozenset({
    "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message", "tokenize",
    "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "sanitize_control_tokens"})
WORKER_START_TIMEOUT_S = 120.0


class ChatTemplateError(ValueError):
    """The request's template or template arguments cannot be used (HTTP 400)."""


class ChatTemplateRenderer:
    def __init__(self, tokenizer: Any, allow_client_template: bool = False, timeout_s: float = 5.0) -> None:
        self.tokenizer = tokenizer
        self.allow_client_template = allow_client_template
        self.timeout_s = timeout_s
        self._worker: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()  # one render at a time per worker

    async def render(self, messages: list[dict], *, add_generation_prompt: bool, continue_final_message: bool,
                     client_kwargs: dict[str, Any] | None = None, **template_args: Any) -> str:
        """The prompt text. `template_args` are the server's own (e.g. tools), passed as is."""
        kwargs = dict(client_kwargs or {})
        reserved = sorted(set(kwargs) & RESERVED_KWARGS)
        if reserved:
            raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        client_template = kwargs.pop("chat_template", None)
        call = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                    **template_args, **kwargs)
        if client_template is None:
            return await asyncio.to_thread(self.tokenizer.apply_chat_template, messages, tokenize=False, **call)
        if not self.allow_client_template:
            raise ChatTemplateError("replacing the chat template is disabled on this server "
                                    "(start it with --allow-client-chat-template)")
        if not isinstance(client_template, str):
            raise ChatTemplateError("chat_template_kwargs.chat_template must be a string")
        return await self._render_isolated(client_template, messages, call)

    async def _render_isolated(self, template: str, messages: list[dict], call: dict[str, Any]) -> str:
        special = {k: v for k, v in getattr(self.tokenizer, "special_tokens_map", {}).items() if isinstance(v, str)}
        job = json.dumps({"template": template, "messages": messages, "kwargs": {**special, **call}}) + "\n"
        async with self._lock:
            worker = await self._ensure_worker()
            worker.stdin.write(job.encode())
            try:
                await worker.stdin.drain()
                line = await asyncio.wait_for(worker.stdout.readline(), self.timeout_s)
            except asyncio.TimeoutError:
                self._kill()
                raise ChatTemplateError(f"the chat template did not render within {self.timeout_s:g} s") from None
            except (BrokenPipeError, ConnectionResetError):
                self._kill()
                raise ChatTemplateError("the chat template worker died") from None
            if not line:
                self._kill()
                raise ChatTemplateError("the chat template worker died (too much memory?)")
        reply = json.loads(line)
        if "error" in reply:
            raise ChatTemplateError(f"cannot apply the chat template: {reply['error']}")
        return reply["text"]

    async def _ensure_worker(self) -> asyncio.subprocess.Process:
        if self._worker is not None and self._worker.returncode is None:
            return self._worker
        self._worker = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "radixlm.srt.chat_template", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, limit=64 * 1024 * 1024)
        try:  # imports transformers: not counted in the render's time limit
            ready = await asyncio.wait_for(self._worker.stdout.readline(), WORKER_START_TIMEOUT_S)
        except asyncio.TimeoutError:
            ready = b""
        if ready.strip() != b"ready":
            self._kill()
            raise ChatTemplateError("the chat template worker did not start")
        return self._worker

    def _kill(self) -> None:
        if self._worker is not None and self._worker.returncode is None:
            self._worker.kill()
        self._worker = None

    async def aclose(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None and worker.returncode is None:
            worker.kill()
            await worker.wait()


def _worker_main() -> None:
    """One JSON job per line on stdin, one JSON answer per line on stdout."""
    import resource

    from transformers.utils.chat_template_utils import render_jinja_template
    try:  # a runaway template must not take the machine's memory with it
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    except (ValueError, OSError):
        pass
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        try:
            job = json.loads(line)
            kw = dict(job["kwargs"])
            texts, _ = render_jinja_template(conversations=[job["messages"]], chat_template=job["template"],
                                             **kw)
            reply = {"text": texts[0]}
        except Exception as e:  # noqa: BLE001 - the template's error, for the client
            reply = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    _worker_main()
