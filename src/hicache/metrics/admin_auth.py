"""Who may send an admin request: the holder of the bearer token, or, without one, a client on this
host that is not a web browser.

Without a token the admin server listens on loopback only (``serve`` refuses any other address),
but a web page the operator opens can still reach loopback: its form or ``fetch`` can POST an
attach that sends every later page elsewhere (CSRF), and a name its owner points at 127.0.0.1 (DNS
rebinding) makes the page same-origin with the server, free to read the answers. A browser always
gives itself away: it sends ``Origin`` on every cross-origin POST and every ``fetch`` that is not a
plain GET, it names the page's host in ``Host`` (``evil.example:9400`` after a rebinding), it sends
``Sec-Fetch-Site`` to loopback (a trustworthy origin) on every request it makes on a page's behalf,
and it cannot send ``Content-Type: application/json`` cross-origin without a CORS preflight, which
this server never grants. So, without a token, an admin request (GET too: the chain's names and
kinds are not a page's business) needs a loopback ``Host`` (``127.0.0.1``, ``localhost``, ``[::1]``,
with or without a port), no ``Origin`` and no ``Sec-Fetch-Site`` but ``none`` (what a person typing
the URL sends). With a token, the token is the guard. Every admin POST, token or not, needs
``Content-Type: application/json`` (a form or text/plain body is what a page sends unasked).
``hicache admin`` (urllib) sends exactly that.
"""

from __future__ import annotations

import hmac
import ipaddress
import re

__all__ = ["admin_refusal"]

_HOST = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[^:\[\]]+))(?::\d{1,5})?")
_TOKEN_HELP = "admin requests need `Authorization: Bearer <token>` (HICACHE_ADMIN_TOKEN)"


def admin_refusal(method: str, headers: list[tuple[str, str]], token: str | None) -> tuple[int, str] | None:
    """``(status, message)`` when this admin request is refused, else ``None``. ``headers``: every
    header as sent (names lower-case), repeats kept."""
    values: dict[str, list[str]] = {}
    for name, value in headers:
        values.setdefault(name, []).append(value)
    if token is not None:
        given = values.get("authorization", [""])[-1]
        if len(values.get("authorization", [])) > 1 or not hmac.compare_digest(
                given.encode(), f"Bearer {token}".encode()):
            return 401, _TOKEN_HELP
    else:
        hosts = values.get("host", [])
        if len(hosts) != 1 or not loopback_host(hosts[0]):
            return 403, ("without an admin token, admin requests need a loopback Host header (127.0.0.1, localhost "
                         "or [::1]): this one may come from a web page (DNS rebinding); set an admin token")
        if "origin" in values:
            return 403, ("without an admin token, admin requests must carry no Origin header: "
                         "this one comes from a web page; set an admin token")
        if any(v.strip().lower() != "none" for v in values.get("sec-fetch-site", [])):
            return 403, ("without an admin token, admin requests must not come from a web page "
                         "(Sec-Fetch-Site); set an admin token")
    if method == "POST":
        types = values.get("content-type", [])
        if len(types) != 1 or types[0].split(";", 1)[0].strip().lower() != "application/json":
            return 415, "admin POSTs need `Content-Type: application/json`"
    return None


def loopback_host(value: str) -> bool:
    """Whether a ``Host`` header names this host's loopback: ``127.0.0.1``, ``localhost`` or ``[::1]``
    (any port or none)."""
    match = _HOST.fullmatch(value.strip())
    if match is None:
        return False
    name = match["v6"] or match["name"]
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
