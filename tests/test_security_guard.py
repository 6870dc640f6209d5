"""RequestGuard and GuardedH11Protocol on a toy app served by uvicorn: keys, body limits, slow clients."""

import socket
import threading
import time

import httpx
import pytest
import uvicorn

from radixrt.server.security import GuardedH11Protocol, RequestGuard

KEY, ADMIN = "sk-test-key", "sk-admin-key"


async def echo_app(scope, receive, send):
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        body += message.get("body", b"")
        if not message.get("more_body", False):
            break
    reply = f"{scope['path']} {len(body)}".encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": reply})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def url():
    app = RequestGuard(echo_app, api_key=KEY, admin_api_key=ADMIN, max_body_bytes=1000, body_timeout=1.0)
    GuardedH11Protocol.header_timeout = 1.0
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                            http=GuardedH11Protocol, limit_concurrency=50)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(5)


def auth(key):
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("headers", [{}, auth("wrong"), {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}])
def test_missing_or_wrong_key_is_401_in_openai_format(url, headers):
    res = httpx.post(url + "/generate", content=b"{}", headers=headers)
    assert res.status_code == 401
    assert res.json()["error"]["code"] == 401 and "API key" in res.json()["error"]["message"]
    assert res.headers["www-authenticate"] == "Bearer"


def test_key_opens_routes_and_health_is_open(url):
    assert httpx.post(url + "/generate", content=b"abc", headers=auth(KEY)).text == "/generate 3"
    assert httpx.get(url + "/health").status_code == 200


def test_admin_routes_need_the_admin_key(url):
    assert httpx.post(url + "/flush_cache", headers=auth(KEY)).status_code == 401
    assert httpx.post(url + "/flush_cache", headers=auth(ADMIN)).status_code == 200
    assert httpx.post(url + "/generate", headers=auth(ADMIN)).status_code == 401  # admin is not a user key


def test_body_over_the_limit_is_413_from_its_length(url):
    started = time.monotonic()
    res = httpx.post(url + "/generate", content=b"x" * 5000, headers=auth(KEY))
    assert res.status_code == 413 and "exceeds the limit of 1000 bytes" in res.json()["error"]["message"]
    assert time.monotonic() - started < 1.0


def test_chunked_body_over_the_limit_is_413_while_reading(url):
    def chunks():
        for _ in range(20):
            yield b"y" * 100

    res = httpx.post(url + "/generate", content=chunks(), headers=auth(KEY))
    assert res.status_code == 413


def test_body_that_trickles_past_the_timeout_is_408_and_others_are_served(url):
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as slow:
        slow.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Length: 100\r\n\r\n".encode())
        started = time.monotonic()
        for _ in range(3):
            slow.sendall(b"z")
            ok = httpx.post(url + "/generate", content=b"fast", headers=auth(KEY))  # others unaffected
            assert ok.status_code == 200
            time.sleep(0.3)
        slow.settimeout(5)
        reply = slow.recv(4096)
        assert b" 408 " in reply.split(b"\r\n", 1)[0]
        assert time.monotonic() - started < 3.0


def test_a_request_head_that_never_completes_is_closed_at_its_timeout(url):
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as slow:
        slow.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")  # no end of headers
        started = time.monotonic()
        slow.settimeout(5)
        assert httpx.get(url + "/health").status_code == 200
        assert slow.recv(4096) == b""  # closed by the server
        assert 0.5 < time.monotonic() - started < 3.0
