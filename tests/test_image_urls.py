"""Image URLs cannot reach inside (issue 27): the server resolves a URL's host first and fetches only from public
addresses (unless --image-url-allow-nets allows a network), connects to the address it checked, and checks every
redirect the same way.

No model: ImageService.fetch runs with a stand-in tower. Traffic goes to loopback test servers only; the filter's
refusals of private addresses are checked with every socket connect trapped, so nothing is ever sent to them.
"""
from __future__ import annotations

import asyncio
import ipaddress
import socket
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dsv41.api.errors import ApiError
from dsv41.api.images import ImageService, UrlPolicy, address_refusal, checked_address

PNG = b"\x89PNG\r\n\x1a\n" + b"not really an image, the fetch does not decode"


def service(**kw) -> ImageService:
    """An ImageService whose fetch works (the tower is not used by it)."""
    return ImageService(types.SimpleNamespace(prep=None), (None, None, None), 0, UrlPolicy(True, 1 << 20, 5.0, **kw))


@pytest.fixture
def no_connects(monkeypatch):
    """Every socket connect in this process is recorded and refused unless it goes to loopback."""
    seen = []
    real = socket.socket.connect

    def guard(self, address, *a):
        seen.append(address)
        host = address[0] if isinstance(address, tuple) else ""
        if host and not ipaddress.ip_address(host.split("%")[0]).is_loopback:
            raise AssertionError(f"a connect to {address} was attempted")
        return real(self, address, *a)

    monkeypatch.setattr(socket.socket, "connect", guard)
    return seen


def fetch(svc: ImageService, url: str) -> bytes:
    return asyncio.run(svc.fetch(url, 0))


def refusal(svc: ImageService, url: str) -> str:
    with pytest.raises(ApiError) as e:
        fetch(svc, url)
    assert e.value.status == 400 and e.value.param == "messages"
    return e.value.message


@pytest.mark.parametrize("addr, why", [
    ("10.0.0.1", "private"), ("192.168.1.1", "private"), ("172.16.5.4", "private"),
    ("169.254.169.254", "link-local"), ("fd00::1", "private"), ("fd00:ec2::254", "private"),
    ("127.0.0.1", "loopback"), ("::1", "loopback"), ("0.0.0.0", "unspecified"), ("::", "unspecified"),
    ("224.0.0.1", "multicast"), ("ff02::1", "multicast"), ("fe80::1", "link-local"),
    ("100.100.100.200", "not a public"), ("192.0.0.192", "not a public"),
    ("::ffff:127.0.0.1", "loopback"), ("::ffff:169.254.169.254", "link-local"), ("64:ff9b::a00:1", "private"),
    ("2002:c0a8:101::", "private"),
])
def test_the_address_filter_refuses_inside_addresses_and_sends_nothing(addr, why, no_connects):
    ip = ipaddress.ip_address(addr)
    assert why in address_refusal(ip)
    svc = service()
    try:
        host = f"[{addr}]" if ip.version == 6 else addr
        msg = refusal(svc, f"http://{host}/latest/meta-data/")
        assert why in msg and "image 1" in msg and "--image-url-allow-nets" in msg
        assert no_connects == []                     # refused after resolving, before any connection
        # allowed explicitly, the filter lets it pass (only the filter is asked here: nothing is fetched)
        assert address_refusal(ip, (ipaddress.ip_network(addr),)) is None
    finally:
        svc.close()


def test_public_addresses_pass_the_filter():
    for addr in ("8.8.8.8", "1.1.1.1", "2606:4700::1111", "::ffff:8.8.8.8"):
        assert address_refusal(ipaddress.ip_address(addr)) is None, addr
    # numeric hosts resolve to themselves: no DNS query, no connection
    assert asyncio.run(checked_address("8.8.8.8", 80)) == "8.8.8.8"
    with pytest.raises(ValueError, match="10.0.0.1 is a private address"):
        asyncio.run(checked_address("10.0.0.1", 80))


class Hits(BaseHTTPRequestHandler):
    """Serves /ok.png; /to?u=URL redirects there (302); /loop redirects to itself. Counts every request."""
    hits: list = []

    def do_GET(self):
        self.hits.append((self.server.server_address[0], self.path, self.headers.get("Host")))
        if self.path.startswith("/to?u="):
            self.send_response(302)
            self.send_header("Location", self.path[len("/to?u="):])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.path == "/loop":
            self.send_response(307)
            self.send_header("Location", "/loop")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(PNG)))
        self.end_headers()
        self.wfile.write(PNG)

    def log_message(self, *a):
        pass


class V6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def serve(server_cls, addr: str):
    srv = server_cls((addr, 0), Hits)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_loopback_urls_and_redirects_to_them_are_refused(no_connects):
    """127.0.0.2/32 allowed (an 'internal image store'); 127.0.0.1, localhost and [::1] are not: asked directly or
    through a redirect from the allowed server, they are refused and their servers get no request."""
    Hits.hits = []
    store = serve(ThreadingHTTPServer, "127.0.0.2")
    inside = serve(ThreadingHTTPServer, "127.0.0.1")
    try:
        inside6 = serve(V6Server, "::1")
    except OSError:                                   # no IPv6 loopback here
        inside6 = None
    svc = service(allow_nets=(ipaddress.ip_network("127.0.0.2/32"),))
    try:
        sp, ip_ = store.server_address[1], inside.server_address[1]
        base = f"http://127.0.0.2:{sp}"
        assert fetch(svc, base + "/ok.png") == PNG                    # the allowed network is fetched
        assert Hits.hits[-1] == ("127.0.0.2", "/ok.png", f"127.0.0.2:{sp}")
        targets = [(f"http://127.0.0.1:{ip_}/ok.png", "127.0.0.1 is a loopback address"),
                   (f"http://localhost:{ip_}/ok.png", "'localhost' resolves to"),
                   (f"http://localhost:{sp}/ok.png", "'localhost' resolves to")]
        if inside6 is not None:
            targets.append((f"http://[::1]:{inside6.server_address[1]}/ok.png", "::1 is a loopback address"))
        for url, why in targets:
            n = len(Hits.hits)
            assert why in refusal(svc, url)                           # directly
            assert why in refusal(svc, f"{base}/to?u={url}")          # through a redirect from the allowed server
            assert [h[1] for h in Hits.hits[n:]] == [f"/to?u={url}"], Hits.hits[n:]   # only the redirect was asked
        assert "more than 3 redirects" in refusal(svc, base + "/loop")
        assert [h[1] for h in Hits.hits].count("/loop") == 4
        assert not any(h[0] in ("127.0.0.1", "::1") for h in Hits.hits)      # the refused servers got nothing
        assert "not an http(s) URL" in refusal(svc, f"{base}/to?u=file:///etc/passwd")
        # the connection went to the checked address only
        assert {a[0] for a in no_connects if isinstance(a, tuple)} == {"127.0.0.2"}
    finally:
        svc.close()
        for s in (store, inside, inside6):
            if s is not None:
                s.shutdown()
