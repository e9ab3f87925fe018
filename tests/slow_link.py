"""A slow link to a real HTTP server: a reverse proxy on loopback that holds back chosen requests.

For faults of timing, such as metrics still on the wire when a process is stopped: every request
goes through to the server unchanged, and a request whose body holds `marker` is held for `delay_s`
first, as a congested or distant link would hold it.
"""

from __future__ import annotations

import http.client
import threading
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"}


def _handler(target: str, marker: bytes, delay_s: float) -> type[BaseHTTPRequestHandler]:
    parsed = urllib.parse.urlsplit(target)

    class Forward(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _forward(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if marker in body:
                time.sleep(delay_s)
            upstream = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=120)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP | {"host"}}
            upstream.request(self.command, self.path, body=body or None, headers=headers)
            response = upstream.getresponse()
            payload = response.read()
            self.send_response(response.status)
            for key, value in response.getheaders():
                if key.lower() not in _HOP_BY_HOP | {"content-length"}:
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            upstream.close()

        do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _forward

        def log_message(self, *args: object) -> None:  # keep the test output clean
            pass

    return Forward


@contextmanager
def slow_link(target: str, marker: bytes, delay_s: float) -> Iterator[str]:
    """A proxy to `target` (http://host:port) that delays requests whose body holds `marker`; yields its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(target, marker, delay_s))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
