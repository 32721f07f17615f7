"""The remote model endpoints the proposers and the judge call: each provider's default address,
and its API key, read from the environment only (never written anywhere, never passed to harness
code)."""

from __future__ import annotations

import ipaddress
import os
import urllib.parse

OPENAI_BASE_URL = "https://api.openai.com/v1"
GEMINI_BASE_URL = "https://generativelanguage.googleapis.com/"
LOOPBACK_KEY = "no-key-loopback"
# Each provider's default address and the variable its key is read from (a flag may name another).
BASE_URLS = {"openai": OPENAI_BASE_URL, "gemini": GEMINI_BASE_URL}
KEY_ENVS = {"openai": "OPENAI_API_KEY", "gemini": "GEMINI_API_KEY"}


class MissingAPIKeyError(RuntimeError):
    """The environment variable that should hold a remote endpoint's API key is unset or empty."""


def is_loopback(url: str) -> bool:
    """Whether ``url`` points at this machine (localhost, 127.0.0.0/8, ::1)."""
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def api_key_from_env(env_name: str, base_url: str, proposer: str) -> str:
    """The key in ``$env_name``; a placeholder for a loopback ``base_url`` if the variable is unset;
    otherwise ``MissingAPIKeyError`` naming the variable."""
    key = os.environ.get(env_name, "").strip()
    if key:
        return key
    if is_loopback(base_url):
        return LOOPBACK_KEY
    raise MissingAPIKeyError(
        f"{proposer}: the environment variable {env_name} is not set; it must hold the API key "
        f"for {base_url} (or pass api_key_env=<the variable that does>)"
    )
