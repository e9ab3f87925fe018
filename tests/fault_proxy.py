"""A fault-injecting HTTP proxy for tests: it sits between a client and a real server
(moto's S3 server) on 127.0.0.1 and makes chosen GETs (or HEADs) fail the way a busy S3 does.

Faults, per object key and for a chosen number of requests (or for ever):
* `slowdown`: answer `503 SlowDown` with S3's XML error body;
* `badkey`: answer `403 InvalidAccessKeyId`, as S3 does to a worker with another account's keys;
* `denied`: answer `403 AccessDenied`, as S3 does when a policy forbids reading that object;
* `reset`: reset the TCP connection before any response;
* `truncate`: forward the request, then send the response head and half the body and reset.

`delay(marker, seconds)` holds back, before forwarding, every request whose body holds `marker`, as a
congested or distant link would: a fault of timing for any HTTP server (metrics still on the wire to
an `mlflow server` when a process is stopped).

A HEAD is answered as S3 answers one: the status line and no body.

Every other request is forwarded byte for byte (a SigV4 signature covers the Host header
the client sent, which stays as it was). One request per connection: the proxy adds
`Connection: close` both ways, so a client never reuses a connection the proxy meant to
drop. Bounded: at most `max_connections` handled at once, socket timeouts, and it shuts
itself down after `lifetime` seconds if a test forgets to.
"""

from __future__ import annotations

import socket
import socketserver
import struct
import threading
import time
from collections import Counter
from urllib.parse import unquote, urlsplit

# fault -> (status line, S3 error code, message): answered without asking the server
_ANSWERS = {
    "slowdown": ("503 Slow Down", "SlowDown", "Please reduce your request rate."),
    "badkey": ("403 Forbidden", "InvalidAccessKeyId", "The AWS Access Key Id you provided does not exist in our records."),
    "denied": ("403 Forbidden", "AccessDenied", "Access Denied"),
}
FAULTS = (*_ANSWERS, "reset", "truncate")


class FaultProxy:
    """Start with `with FaultProxy(upstream_url) as proxy:`; point the client at `proxy.url`."""

    def __init__(self, upstream: str, *, max_connections: int = 32, timeout: float = 30.0, lifetime: float = 600.0):
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.timeout = timeout
        self.lifetime = lifetime
        self.injected: Counter[tuple[str, str]] = Counter()  # (key, fault) -> times done
        self.served: Counter[str] = Counter()  # key -> GETs forwarded untouched
        self._plan: dict[tuple[str, str], tuple[str, int | None]] = {}  # (method, key) -> (fault, times left)
        self._delays: dict[bytes, float] = {}  # body marker -> seconds to hold the request
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.proxy = self
        self._timer = threading.Timer(lifetime, self.stop)
        self._timer.daemon = True

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def fail(self, key: str, fault: str, times: int | None = 1, method: str = "GET") -> None:
        """Make the next `times` `method` requests ("GET" or "HEAD") of `key` (a bucket-relative object key)
        fail; None: every one."""
        if fault not in FAULTS or method not in ("GET", "HEAD") or (method == "HEAD" and fault not in _ANSWERS):
            raise ValueError(f"fault must be one of {FAULTS}, on GET; or of {tuple(_ANSWERS)} on HEAD")
        with self._lock:
            self._plan[method, key] = (fault, times)

    def delay(self, marker: bytes, seconds: float) -> None:
        """Hold every request whose body holds `marker` for `seconds` before forwarding it."""
        with self._lock:
            self._delays[marker] = seconds

    def clear(self) -> None:
        """No more faults."""
        with self._lock:
            self._plan.clear()
            self._delays.clear()

    def __enter__(self) -> FaultProxy:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop serving (idempotent)."""
        self._timer.cancel()
        self._server.shutdown()
        self._server.server_close()

    def _fault_for(self, method: str, target: str) -> tuple[str, str] | None:
        path = unquote(urlsplit(target).path)
        with self._lock:
            for (planned, key), (fault, times) in self._plan.items():
                if planned == method and path.endswith("/" + key):
                    if times is not None:
                        if times <= 0:
                            continue
                        self._plan[planned, key] = (fault, times - 1)
                    self.injected[key, fault] += 1
                    return key, fault
            return None


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    proxy: FaultProxy


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        proxy: FaultProxy = self.server.proxy  # type: ignore[attr-defined]
        client: socket.socket = self.request
        client.settimeout(proxy.timeout)
        with proxy._slots:
            try:
                self._one_request(proxy, client)
            except OSError:
                pass  # the client went away; nothing to answer

    def _one_request(self, proxy: FaultProxy, client: socket.socket) -> None:
        head, body = _read_message(client)
        if head is None:
            return
        request_line, *header_lines = head.decode("latin-1").split("\r\n")
        method, target, _ = request_line.split(" ", 2)
        headers = [h for h in header_lines if h and not h.lower().startswith(("connection:", "expect:"))]
        with proxy._lock:
            hold = max((s for marker, s in proxy._delays.items() if marker in body), default=0.0)
        time.sleep(hold)
        fault = proxy._fault_for(method, target)
        if fault is not None and fault[1] in _ANSWERS:
            status, code, message = _ANSWERS[fault[1]]
            body = b"" if method == "HEAD" else (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                                                 f"<Message>{message}</Message></Error>").encode()
            client.sendall(f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
                           "Connection: close\r\n\r\n".encode() + body)
            return
        if fault is not None and fault[1] == "reset":
            _reset(client)
            return
        response = _forward(proxy, "\r\n".join([request_line, *headers, "Connection: close", "", ""]).encode() + body)
        if fault is not None:  # truncate: the head and half the body, then a reset
            split = response.index(b"\r\n\r\n") + 4
            client.sendall(response[: split + (len(response) - split) // 2])
            _reset(client)
            return
        if method == "GET":
            with proxy._lock:
                proxy.served[unquote(urlsplit(target).path)] += 1
        client.sendall(response)


def _read_message(sock: socket.socket) -> tuple[bytes | None, bytes]:
    """A request's head and its Content-Length body (answering `Expect: 100-continue` first)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None, b""
        data += chunk
        if len(data) > 1 << 20:
            raise OSError("request head too large")
    head, _, rest = data.partition(b"\r\n\r\n")
    lower = head.lower()
    length = 0
    for line in lower.split(b"\r\n")[1:]:
        if line.startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    if b"expect: 100-continue" in lower:
        sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    while len(rest) < length:
        chunk = sock.recv(min(1 << 20, length - len(rest)))
        if not chunk:
            raise OSError("request body cut short")
        rest += chunk
    return head, rest


def _forward(proxy: FaultProxy, request: bytes) -> bytes:
    """Send `request` upstream and return the whole response (the upstream closes after it)."""
    with socket.create_connection(proxy.upstream, timeout=proxy.timeout) as upstream:
        upstream.sendall(request)
        chunks = []
        while chunk := upstream.recv(1 << 20):
            chunks.append(chunk)
    response = b"".join(chunks)
    head, sep, body = response.partition(b"\r\n\r\n")
    lines = [h for h in head.split(b"\r\n") if not h.lower().startswith((b"connection:", b"keep-alive:"))]
    return b"\r\n".join([*lines, b"Connection: close"]) + sep + body


def _reset(sock: socket.socket) -> None:
    """Close with a TCP reset (RST), as a dropped connection looks to the client."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
