"""One TLS context for every httpx client milepost makes.

httpx builds a fresh SSL context for each client (a module-level `httpx.get` makes a client per
call) and loads the whole CA bundle into it: ~40 ms of CPU each time, though every milepost URL
is plain http on loopback or a cluster network. Health polls every 0.2-0.5 s and per-rollout
clients made that a visible share of a small run's CPU. The context is built once, the same way
httpx builds it (SSL_CERT_FILE / SSL_CERT_DIR honoured), and passed as `verify=`.
"""

from __future__ import annotations

import functools
import ssl

import httpx


@functools.cache
def tls_context() -> ssl.SSLContext:
    """httpx's default verifying context, built on first use and shared (thread-safe to share)."""
    return httpx.create_ssl_context()
