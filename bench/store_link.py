"""A bandwidth-limited link between a host and the blob store, for the benchmark.

The coordinator's blob server runs on this machine, so a restore downloads
its packs at memory speed: a host pack cache can only save what a download
costs, and on loopback that is nothing. Sandboxes in production reach their
store (S3, GCS, a blob server in another rack) over a network. This models
that link: an HTTP forward proxy (the runner honours HTTP_PROXY for the
signed URLs, as it would a site proxy) that relays requests unchanged and
paces every response and request body through one shared token bucket, so
all of a restore's parallel downloads together get `bytes_per_s`.

    link = StoreLink(100 << 20)      # 100 MiB/s
    env["HTTP_PROXY"] = link.url
    ...
    link.relayed_bytes               # what went through it
    link.stop()
"""
import http.client
import http.server
import threading
import time
import urllib.parse

# Hop-by-hop headers (RFC 9110 7.6.1) are the proxy's own, not relayed.
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "proxy-authorization", "te", "trailer",
              "transfer-encoding", "upgrade"}
PIECE = 64 << 10


class TokenBucket:
    """Paces bytes to a rate, shared by every connection; bursts of at most 1/20 s."""

    def __init__(self, bytes_per_s):
        self.rate = float(bytes_per_s)
        self.capacity = self.rate / 20
        self.tokens = self.capacity
        self.stamp = time.monotonic()
        self.lock = threading.Lock()

    def take(self, n):
        while True:
            with self.lock:
                now = time.monotonic()
                self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
                self.stamp = now
                if self.tokens >= n or self.tokens >= self.capacity:
                    self.tokens -= n
                    return
                wait = (min(n, self.capacity) - self.tokens) / self.rate
            time.sleep(wait)


class StoreLink:
    """A forward proxy on 127.0.0.1 limited to `bytes_per_s` in total."""

    def __init__(self, bytes_per_s):
        self.bucket = TokenBucket(bytes_per_s)
        self.relayed_bytes = 0
        self._count_lock = threading.Lock()
        link = self

        class Relay(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def relay(self):
                target = urllib.parse.urlsplit(self.path)
                if target.scheme != "http" or not target.hostname:
                    self.send_error(400, "a forward proxy takes absolute http:// URLs")
                    return
                length = int(self.headers.get("Content-Length") or 0)
                body = bytearray()
                while len(body) < length:
                    piece = self.rfile.read(min(PIECE, length - len(body)))
                    if not piece:
                        break
                    link.pace(len(piece))
                    body += piece
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                upstream = http.client.HTTPConnection(target.hostname, target.port or 80, timeout=120)
                try:
                    path = target.path + ("?" + target.query if target.query else "")
                    upstream.request(self.command, path, body=bytes(body) if length else None, headers=headers)
                    response = upstream.getresponse()
                    self.send_response(response.status, response.reason)
                    chunked = response.getheader("Content-Length") is None and self.command != "HEAD"
                    for k, v in response.getheaders():
                        if k.lower() not in HOP_BY_HOP:
                            self.send_header(k, v)
                    if chunked:
                        self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    while self.command != "HEAD":
                        piece = response.read(PIECE)
                        if not piece:
                            break
                        link.pace(len(piece))
                        if chunked:
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                        else:
                            self.wfile.write(piece)
                    if chunked:
                        self.wfile.write(b"0\r\n\r\n")
                finally:
                    upstream.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = relay

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Relay)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def pace(self, n):
        self.bucket.take(n)
        with self._count_lock:
            self.relayed_bytes += n

    def stop(self):
        self.server.shutdown()
        self.server.server_close()
