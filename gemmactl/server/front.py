"""The HTTP front: OpenAI-compatible endpoints, /health and /metrics, on a threading HTTP server.

One thread per connection; a request holds a thread while it waits in its tier's queue and while
it streams. Answers stream as server-sent events over chunked HTTP/1.1 so that connections are
kept alive between requests.
"""

from __future__ import annotations

import hmac
import http.client
import io
import json
import logging
import select
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from gemmactl.errors import BackendError, GemmactlError, ServerError, UnknownTierError, UserInputError
from gemmactl.generate import stream_generate
from gemmactl.llamacpp.server import RequestCancelled
from gemmactl.runtime.base import GenerationStats
from gemmactl.server import api
from gemmactl.server.backends import BackendDown
from gemmactl.server.lanes import Saturated, Unavailable
from gemmactl.server.metrics import health, metrics_json, metrics_text, models
from gemmactl.server.peers import FORWARDED_HEADER

log = logging.getLogger("gemmactl.serve")

RETRY_AFTER_S = 2
MAX_BODY = 16 * 2**20
PEER_TIMEOUT_S = 600
READ_TIMEOUT_S = 30.0  # to read one whole request (line, headers, body), and the longest idle keep-alive
WRITE_TIMEOUT_S = 60.0  # for one write to a client that stopped reading
CLIENT_CHECK_S = 0.25  # how often an answer being generated looks whether its client is still there
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 2\r\n"
         b"Connection: close\r\nContent-Length: %d\r\n\r\n%s")


class FrontServer(ThreadingHTTPServer):
    daemon_threads = True
    # A burst of hundreds of connections must wait in the kernel's backlog, not be refused.
    request_queue_size = 1024

    def __init__(self, address, handler, service):
        self.service = service
        self.max_connections = service.config.max_connections
        self.open_connections = 0
        self._count = threading.Lock()
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        """A thread per connection, up to max_connections; past that, a 503 at once and no thread."""
        with self._count:
            full = self.open_connections >= self.max_connections
            if not full:
                self.open_connections += 1
        if full:
            body = json.dumps(api.error_body(f"too many open connections ({self.max_connections})",
                                             "overloaded_error", 503)).encode()
            try:
                request.settimeout(1.0)
                request.sendall(_BUSY % (len(body), body))
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release()

    def _release(self) -> None:
        with self._count:
            self.open_connections -= 1

    def handle_error(self, request, client_address):
        """A client that went away or stalled is one line in the log, not a traceback."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError, socket.timeout, _ClientGone)):
            log.info("connection from %s ended early: %s", client_address[0], exc or type(exc).__name__)
        else:
            log.exception("request from %s failed", client_address[0])


class _DeadlineReader(io.RawIOBase):
    """The connection's reading side with one deadline for a whole request (slow senders included)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.deadline = time.monotonic() + READ_TIMEOUT_S

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the request did not arrive within {READ_TIMEOUT_S:.0f} s")
        self.sock.settimeout(left)
        try:
            return self.sock.recv_into(buffer)
        finally:
            self.sock.settimeout(WRITE_TIMEOUT_S)


def make_http_server(service) -> FrontServer:
    return FrontServer((service.config.host, service.config.port), FrontHandler, service)


class _ClientGone(Exception):
    """The client closed its connection while the answer was being written."""


class FrontHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "gemmactl"
    timeout = WRITE_TIMEOUT_S

    def setup(self):
        super().setup()
        self._reader = _DeadlineReader(self.connection)
        self.rfile = io.BufferedReader(self._reader)

    def handle_one_request(self):
        # Each request (and the wait for it on a kept-alive connection) gets READ_TIMEOUT_S to arrive.
        self._reader.deadline = time.monotonic() + READ_TIMEOUT_S
        super().handle_one_request()

    @property
    def service(self):
        return self.server.service

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        log.debug("%s %s", self.address_string(), format % args)

    # -- routing ----------------------------------------------------------------------------------

    def do_GET(self):
        path = urlsplit(self.path)
        if path.path == "/health":
            data = health(self.service)
            return self._json(200 if data["status"] != "down" else 503, data)
        if not self._authorized():
            return
        if path.path == "/v1/models":
            return self._json(200, models(self.service))
        if path.path == "/metrics":
            query = parse_qs(path.query)
            if query.get("format") == ["json"] or "application/json" in self.headers.get("Accept", ""):
                return self._json(200, metrics_json(self.service))
            return self._send(200, metrics_text(self.service).encode(), "text/plain; version=0.0.4")
        self._json(404, api.error_body(f"no endpoint {path.path}", "not_found_error", 404))

    def do_POST(self):
        path = urlsplit(self.path).path
        kind = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}.get(path)
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            self.close_connection = True
            return self._json(413, api.error_body("request body too large", "invalid_request_error", 413))
        raw = self.rfile.read(length) if length else b""
        if kind is None:
            return self._json(404, api.error_body(f"no endpoint {path}", "not_found_error", 404))
        if not self._authorized():
            return
        try:
            body = json.loads(raw or b"null")
            routed = api.parse_request(kind, body, self.service.recipe)
        except ValueError:
            return self._json(400, api.error_body("the body is not valid JSON", "invalid_request_error", 400))
        except GemmactlError as exc:
            return self._error(exc)
        self._answer(routed, path, raw)

    # -- answering --------------------------------------------------------------------------------

    def _answer(self, routed: api.Routed, path: str, raw: bytes) -> None:
        lane = self.service.lanes[routed.tier]
        try:
            with lane.slot(self.service.config.request_timeout):
                self._generate(routed, lane)
        except (Saturated, Unavailable, BackendDown) as exc:
            if isinstance(exc, BackendDown):
                lane.count("rejected")
            if not self.headers.get(FORWARDED_HEADER) and self._forward(routed.tier, path, raw, lane):
                return
            self._json(503, api.error_body(exc.message, "overloaded_error" if isinstance(exc, Saturated)
                                           else "unavailable_error", 503), {"Retry-After": str(RETRY_AFTER_S)})
        except _ClientGone:
            log.debug("client went away during a %s request", routed.tier)

    def _generate(self, routed: api.Routed, lane) -> None:
        session = lane.backend.session(client_gone=self._client_gone)
        events = stream_generate(session, routed.request)
        try:
            first = self._next(events, lane)  # before any header: errors here get a proper status
            if first is _FAILED:
                return
            if routed.stream:
                self._stream(routed, lane, session, first, events)
            else:
                self._collect(routed, lane, session, first, events)
        finally:
            events.close()

    def _next(self, events, lane):
        try:
            return next(events)
        except StopIteration:
            return None
        except RequestCancelled:
            raise _ClientGone() from None  # a whole answer abandoned: llama-server freed the slot
        except BackendDown:
            raise  # nothing sent yet: answered 503 with Retry-After (or by a peer) like a down tier
        except (BackendError, ServerError) as exc:
            lane.count("errors")
            self._json(502, api.error_body(exc.message, "backend_error", 502))
        except GemmactlError as exc:
            lane.count("errors")
            self._error(exc)
        return _FAILED

    def _collect(self, routed, lane, session, first, events) -> None:
        parts = {"answer": [], "thinking": []}
        stats = None
        watch = _ClientWatch(self._client_gone)
        try:
            for event in _chain(first, events):
                watch.check()
                if isinstance(event, GenerationStats):
                    stats = event
                else:
                    parts[event.channel].append(event.text)
        except GemmactlError as exc:
            lane.count("errors")
            return self._json(502, api.error_body(exc.message, "backend_error", 502))
        counters = session.counters()
        lane.record(stats, counters)
        self._json(200, api.full_response(routed, "".join(parts["answer"]), "".join(parts["thinking"]), stats,
                                          counters), {"X-Gemmactl-Tier": routed.tier})

    def _stream(self, routed, lane, session, first, events) -> None:
        self._start_chunked(200, "text/event-stream", {"X-Gemmactl-Tier": routed.tier, "Cache-Control": "no-cache"})
        if routed.kind == "chat":
            self._event(api.chunk(routed, first=True))
        stats = None
        started = False  # chat answers lose their leading whitespace, as `run` strips them
        watch = _ClientWatch(self._client_gone)  # hidden thinking writes nothing for a while
        try:
            for event in _chain(first, events):
                watch.check()
                if isinstance(event, GenerationStats):
                    stats = event
                    continue
                if event.channel == "thinking" and not routed.reasoning:
                    continue
                text = event.text
                if event.channel == "answer" and not started:
                    if routed.kind == "chat":
                        text = text.lstrip()
                    if not text.strip():
                        if text:
                            self._event(api.chunk(routed, text=text, channel=event.channel))
                        continue
                    started = True
                self._event(api.chunk(routed, text=text, channel=event.channel))
        except GemmactlError as exc:
            lane.count("errors")
            self._event(api.error_body(exc.message, "backend_error", 502))
            self._end_chunked()
            return
        counters = session.counters()
        lane.record(stats, counters)
        self._event(api.chunk(routed, finish=api.finish_reason(stats)))
        if routed.include_usage:
            self._event(api.usage_chunk(routed, stats, counters, empty=not started))
        self._write_chunk(b"data: [DONE]\n\n")
        self._end_chunked()

    # -- peers ------------------------------------------------------------------------------------

    def _forward(self, tier: str, path: str, raw: bytes, lane) -> bool:
        """Relay the request to a peer that can take it; False when none can (or it fails to answer)."""
        peer = self.service.peers.pick(tier)
        if peer is None:
            return False
        parts = urlsplit(peer.url)
        connection = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=PEER_TIMEOUT_S)
        headers = {"Content-Type": "application/json", FORWARDED_HEADER: "1"}
        if self.headers.get("Authorization"):
            headers["Authorization"] = self.headers["Authorization"]
        try:
            connection.request("POST", path, raw, headers)
            response = connection.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            log.warning("peer %s did not answer: %s", peer.url, exc)
            peer.healthy = False
            connection.close()
            return False
        lane.count("forwarded")
        peer.forwarded += 1
        try:
            extra = {"X-Gemmactl-Peer": peer.url}
            for name in ("Retry-After", "X-Gemmactl-Tier"):
                if response.getheader(name):
                    extra[name] = response.getheader(name)
            self._start_chunked(response.status, response.getheader("Content-Type", "application/json"), extra)
            while True:
                try:
                    data = response.read1(65536)
                except (OSError, http.client.HTTPException) as exc:
                    log.warning("peer %s broke off its answer: %s", peer.url, exc)
                    break
                if not data:
                    break
                self._write_chunk(data)
            self._end_chunked()
        finally:
            connection.close()
        return True

    # -- HTTP plumbing ----------------------------------------------------------------------------

    def _authorized(self) -> bool:
        key = self.service.config.api_key
        if not key:
            return True
        given = self.headers.get("Authorization", "")
        token = given[7:].strip() if given[:7].lower() == "bearer " else self.headers.get("X-Api-Key", "")
        if token and hmac.compare_digest(token.encode(), key.encode()):
            return True
        self._json(401, api.error_body("missing or wrong API key: send 'Authorization: Bearer KEY'",
                                       "authentication_error", 401), {"WWW-Authenticate": "Bearer"})
        return False

    def _client_gone(self) -> bool:
        """True once the client has closed its side (a next request already sent does not count)."""
        try:
            if not select.select([self.connection], [], [], 0)[0]:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _error(self, exc: GemmactlError) -> None:
        if isinstance(exc, UnknownTierError):
            status, kind = 404, "not_found_error"
        elif isinstance(exc, UserInputError):
            status, kind = 400, "invalid_request_error"
        else:
            status, kind = 500, "server_error"
        message = f"{exc.message}. {exc.hint}" if exc.hint else exc.message
        self._json(status, api.error_body(message, kind, status))

    def _json(self, status: int, data: dict, headers: dict | None = None) -> None:
        self._send(status, json.dumps(data).encode(), "application/json", headers)

    def _send(self, status: int, payload: bytes, content_type: str, headers: dict | None = None) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(payload)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError, socket.timeout) as exc:
            raise _ClientGone() from exc

    def _start_chunked(self, status: int, content_type: str, headers: dict | None = None) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Transfer-Encoding", "chunked")
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
        except (BrokenPipeError, ConnectionResetError, socket.timeout) as exc:
            raise _ClientGone() from exc

    def _event(self, data: dict) -> None:
        self._write_chunk(b"data: " + json.dumps(data).encode() + b"\n\n")

    def _write_chunk(self, data: bytes) -> None:
        try:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, socket.timeout) as exc:
            self.close_connection = True
            raise _ClientGone() from exc

    def _end_chunked(self) -> None:
        self._write_chunk(b"")


_FAILED = object()


class _ClientWatch:
    """Asks whether the client went away at most every CLIENT_CHECK_S; raises _ClientGone if so,
    which ends the request: its events are closed and llama-server's task with them."""

    def __init__(self, gone):
        self.gone = gone
        self.next = time.monotonic() + CLIENT_CHECK_S

    def check(self) -> None:
        now = time.monotonic()
        if now >= self.next:
            self.next = now + CLIENT_CHECK_S
            if self.gone():
                raise _ClientGone()


def _chain(first, events):
    if first is not None:
        yield first
    yield from events
