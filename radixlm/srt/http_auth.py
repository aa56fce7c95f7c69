"""Who may call what: API keys, the control routes' admin key, and browser-origin checks.

Levels (as SGLang groups its routes; docs/serving.md "Security and limits"):
- open: /health, /health_generate, /metrics (probes and scrapers carry no secrets);
- normal: everything else that reads or generates; needs --api-key when one is set
  (the admin key works too);
- admin: the control routes (ADMIN_ROUTES: pause, weights, memory, flush, abort, version);
  need --admin-api-key when set, else --api-key when set, else nothing.
A key is sent as `Authorization: Bearer <key>` (what the openai client sends) or `x-api-key`.

Browsers: a page on another site can make the user's browser POST to a loopback server
(a "simple" request needs no CORS preflight), and DNS rebinding can give such a page a
host name that resolves to 127.0.0.1. So a state-changing request (any POST/PUT/PATCH/
DELETE, and any request to an admin route) that a browser marks as cross-origin (an
`Origin` that is not the request's own host, or `Sec-Fetch-Site: cross-site/same-site`)
is refused (403), and a server bound to a loopback address answers a browser's request only
when its `Host` is a loopback name (or one of --allowed-hosts, e.g. behind a reverse proxy).
A request is a browser's when it carries `Origin` or `Sec-Fetch-Site` (every current browser
sends one of them); other clients (curl, SDKs, proxies' health checks) send neither and are
not affected.

`AuthInfo` (request.state.auth) tells handlers what the caller proved: `admin` (may use
the control routes) and `authenticated` (presented a key that grants it): error details that
would reveal the file system are given only to authenticated admins.
"""
from __future__ import annotations

import ipaddress
import secrets
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from radixlm.srt.http_utils import error_response

OPEN_ROUTES = ("/health", "/health_generate", "/metrics")
ADMIN_ROUTES = frozenset({
    "/pause_generation", "/continue_generation", "/flush_cache", "/abort_request",
    "/update_weights_from_tensor", "/update_weights_from_disk", "/update_weight_version",
    "/get_weights_by_name", "/release_memory_occupation", "/resume_memory_occupation",
    "/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group",
})
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class AuthInfo:
    admin: bool  # may use the control routes
    authenticated: bool  # presented the key that grants that


def route_level(path: str) -> str:
    if path in OPEN_ROUTES:
        return "open"
    return "admin" if path in ADMIN_ROUTES else "normal"


def _matches(presented: str | None, key: str | None) -> bool:
    return bool(key) and presented is not None and secrets.compare_digest(presented.encode(), key.encode())


def presented_key(headers: dict[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("x-api-key") or None


def decide(level: str, presented: str | None, api_key: str | None,
           admin_api_key: str | None) -> tuple[bool, AuthInfo]:
    """(allowed, what the caller proved) for a route of `level`."""
    admin_key = admin_api_key or api_key  # without an admin key, the API key guards the controls
    is_admin = admin_key is None or _matches(presented, admin_key)
    info = AuthInfo(admin=is_admin, authenticated=admin_key is not None and is_admin)
    if level == "open":
        return True, info
    if level == "admin":
        return is_admin, info
    return api_key is None or _matches(presented, api_key) or _matches(presented, admin_api_key), info


def is_loopback_bind(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_name(host_header: str) -> str:
    host = host_header.strip().lower()
    if host.startswith("["):  # [::1]:30000
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def browser_refusal(method: str, level: str, headers: dict[str, str], loopback: bool,
                    allowed_hosts: tuple[str, ...] = ()) -> str | None:
    """Why a request that looks like a browser's cross-origin one is refused, or None."""
    host = headers.get("host", "")
    browser = "origin" in headers or "sec-fetch-site" in headers
    if browser and loopback and _host_name(host) not in LOOPBACK_NAMES + allowed_hosts:
        return f"host {host!r} is not this server's (bound to a loopback address; see --allowed-hosts)"
    if method in SAFE_METHODS and level != "admin":
        return None
    site = headers.get("sec-fetch-site", "").lower()
    if site in ("cross-site", "same-site"):
        return "cross-origin browser requests are not allowed"
    origin = headers.get("origin")
    if origin is not None:
        if origin == "null" or urlsplit(origin).netloc.lower() != host.lower():
            return f"origin {origin!r} is not allowed"
    return None


class AuthMiddleware:
    """ASGI middleware (not BaseHTTPMiddleware: that would hide client disconnects)."""

    def __init__(self, app: ASGIApp, api_key: str | None, admin_api_key: str | None, bind_host: str,
                 allowed_hosts: str | None = None) -> None:
        self.app = app
        self.api_key = api_key or None
        self.admin_api_key = admin_api_key or None
        self.loopback = is_loopback_bind(bind_host)
        self.allowed_hosts = tuple(h.strip().lower() for h in (allowed_hosts or "").split(",") if h.strip())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        level = route_level(scope["path"])
        why = browser_refusal(scope["method"], level, headers, self.loopback, self.allowed_hosts)
        if why is not None:
            await error_response(why, 403)(scope, receive, send)
            return
        allowed, info = decide(level, presented_key(headers), self.api_key, self.admin_api_key)
        if not allowed:
            key = "an admin API key" if level == "admin" and self.admin_api_key else "an API key"
            response = error_response(f"this route needs {key}: send it as 'Authorization: Bearer <key>'", 401)
            response.headers["www-authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})["auth"] = info
        await self.app(scope, receive, send)


def auth_of(request) -> AuthInfo:
    """What the caller proved (admin and authenticated when no middleware ran: tests)."""
    return getattr(request.state, "auth", AuthInfo(admin=True, authenticated=True))
