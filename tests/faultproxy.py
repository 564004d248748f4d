"""A fault-injecting HTTP proxy in front of the test S3 server (moto's, on
127.0.0.1): requests pass through unchanged until a rule says otherwise, then
the proxy answers as a throttled or failing store does (S3's 503 SlowDown).

    with FaultProxy(s3_server) as proxy:
        os.environ["AWS_ENDPOINT_URL"] = proxy.url
        proxy.fail("GET", "checkpoint.json")   # every GET of a key ending so: 503
        ...
        proxy.clear()

Only loopback traffic; the server thread stops with the context."""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}


class FaultProxy:
    def __init__(self, upstream: str):
        target = urlsplit(upstream)
        self.upstream = (target.hostname or "127.0.0.1", target.port or 80)
        self.rules: list[tuple[str, str]] = []
        self.faults = 0  # requests answered with a fault
        self.connections: set = set()  # open client connections (kept alive by the SDKs)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                proxy.connections.add(self.connection)

            def finish(self) -> None:
                proxy.connections.discard(self.connection)
                super().finish()

            def log_message(self, *args: object) -> None:  # quiet
                return

            def _handle(self) -> None:
                if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                    body = self._read_chunked()  # the SDK may send an upload in chunks
                else:
                    length = int(self.headers.get("Content-Length") or 0)
                    body = self.rfile.read(length) if length else b""
                path = urlsplit(self.path).path
                if any(m == self.command and path.endswith(s) for m, s in proxy.rules):
                    proxy.faults += 1
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(SLOW_DOWN)
                    return
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status, resp.reason)
                head = self.command == "HEAD"  # its Content-Length is the object's size
                for k, v in resp.getheaders():
                    if k.lower() not in HOP_BY_HOP and (head or k.lower() != "content-length"):
                        self.send_header(k, v)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            def _read_chunked(self) -> bytes:
                parts = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass  # trailers
                        return b"".join(parts)
                    parts.append(self.rfile.read(size))
                    self.rfile.readline()  # the CRLF after the chunk

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def down(self) -> None:
        """The endpoint goes away: open connections are cut (the SDKs keep them
        alive between requests) and new ones refused until `up`."""
        import contextlib
        import socket

        self.server.shutdown()
        self.server.server_close()
        for conn in list(self.connections):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def up(self) -> None:
        """The endpoint answers again, on the same port."""
        port = self.server.server_address[1]
        self.server = ThreadingHTTPServer(("127.0.0.1", port), self.server.RequestHandlerClass)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def fail(self, method: str, suffix: str) -> None:
        """Answer every `method` request for a key ending in `suffix` with 503 SlowDown."""
        self.rules.append((method, suffix))

    def clear(self) -> None:
        self.rules.clear()

    def __enter__(self) -> FaultProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
