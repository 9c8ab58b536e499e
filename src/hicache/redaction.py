"""Keeping secrets out of what hicache prints: URL passwords and secret-named values, masked.

Used by the config's errors, reprs and dumps, and by storage errors that quote a client's message.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import SecretStr

__all__ = ["SECRET_MASK", "SECRET_NAME", "mask_url", "redacted"]

SECRET_MASK = "**********"
_URL = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<netloc>[^/?#]*)(?P<rest>.*)", re.DOTALL)
_QUERY_SECRET = re.compile(r"(?i)([?&;][^=&;#]*(?:pass|secret|token|auth|credential)[^=&;#]*=)[^&;#]*")
SECRET_NAME = re.compile(r"(?i)pass|secret|token|credential|tenant_key|auth")


def mask_url(text: str) -> str:
    """``text`` with every password a URL can carry replaced by the mask.

    redis-py (``urllib.parse``) takes the password between the first ``:`` of the user info and
    the *last* ``@`` before the host, so a password may contain ``@``; it also takes
    ``?password=...`` from the query. User info without a ``:`` is masked whole (it is sometimes a
    password written without the colon), and so is any query value whose name mentions a password,
    secret, token or credential.
    """
    match = _URL.fullmatch(text)
    if match is None:
        return text
    netloc = match["netloc"]
    userinfo, at, host = netloc.rpartition("@")
    if at:
        user, colon, _password = userinfo.partition(":")
        netloc = f"{user}:{SECRET_MASK}@{host}" if colon else f"{SECRET_MASK}@{host}"
    rest = _QUERY_SECRET.sub(lambda m: m.group(1) + SECRET_MASK, match["rest"])
    return match["scheme"] + netloc + rest


def redacted(value: Any, depth: int = 0) -> Any:
    """A copy of ``value`` fit to print: secret-named entries and URL passwords masked."""
    if depth > 8:
        return "..."
    if isinstance(value, Mapping):
        return {
            k: SECRET_MASK if isinstance(k, str) and SECRET_NAME.search(k) and v is not None else redacted(v, depth + 1)
            for k, v in list(value.items())[:32]
        }
    if isinstance(value, list | tuple):
        return [redacted(v, depth + 1) for v in value[:32]]
    if isinstance(value, SecretStr):
        return SECRET_MASK
    if isinstance(value, str) and "://" in value:
        return mask_url(value)
    return value
