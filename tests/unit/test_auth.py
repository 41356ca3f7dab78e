"""milepost/auth.py: the api-key middleware (any FastAPI app: engine, session server), the
exposure warning, loopback detection and the client headers."""

from __future__ import annotations

import logging

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from milepost.auth import (
    client_headers,
    is_loopback,
    protect,
    use_api_key,
    warn_if_exposed,
)

KEY = "s3cret-key-123"


@pytest.fixture
def client() -> TestClient:
    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        return {"ok": True}

    @app.post("/update_weights_from_tensor")
    def update(body: dict) -> dict:
        return {"got": body}

    protect(app, KEY)
    return TestClient(app)


@pytest.mark.parametrize("headers, status", [
    ({}, 401), ({"Authorization": "Bearer wrong"}, 401), ({"Authorization": KEY}, 401),
    ({"Authorization": f"Bearer {KEY}x"}, 401), ({"Authorization": f"bearer {KEY}"}, 401),
    ({"Authorization": f"Bearer {KEY}"}, 200),
])
def test_every_route_but_health_needs_the_key(client: TestClient, headers, status) -> None:
    r = client.post("/update_weights_from_tensor", json={"a": 1}, headers=headers)
    assert r.status_code == status, r.text
    if status == 401:
        assert "--api-key" in r.json()["error"]["message"] and r.headers["www-authenticate"] == "Bearer"
    assert client.get("/health").status_code == 200


def test_no_key_means_no_check() -> None:
    app = FastAPI()

    @app.get("/x")
    def x() -> dict:
        return {}

    protect(app, None)
    assert TestClient(app).get("/x").status_code == 200


def test_exposure_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert warn_if_exposed("0.0.0.0", None, "milepost serve")
        assert not warn_if_exposed("0.0.0.0", KEY, "milepost serve")
        assert not warn_if_exposed("127.0.0.1", None, "milepost serve")
    assert caplog.text.count("without --api-key") == 1
    assert [is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost",
                                     "0.0.0.0", "::", "10.0.0.1", "example.com")] == [
        True, True, True, True, True, False, False, False, False]


def test_client_headers_follow_use_api_key() -> None:
    try:
        assert client_headers() == {}
        use_api_key(KEY)
        assert client_headers() == {"Authorization": f"Bearer {KEY}"}
    finally:
        use_api_key(None)
    assert client_headers() == {}
