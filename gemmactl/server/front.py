"""The HTTP front: OpenAI-compatible endpoints, /health and /metrics, on a threading HTTP server.

One thread per connection; a request holds a thread while it waits in its tier's queue and while
it streams. Answers stream as server-sent events over chunked HTTP/1.1 so that connections are
kept alive between requests.
"""

from __future__ import annotations

import hmac
import http.client
import json
import logging
import socket
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from gemmactl.errors import BackendError, GemmactlError, ServerError, UnknownTierError, UserInputError
from gemmactl.generate import stream_generate
from gemmactl.runtime.base import GenerationStats
from gemmactl.server import api
from gemmactl.server.lanes import Saturated, Unavailable
from gemmactl.server.metrics import health, metrics_json, metrics_text, models
from gemmactl.server.peers import FORWARDED_HEADER

log = logging.getLogger("gemmactl.serve")

RETRY_AFTER_S = 2
MAX_BODY = 16 * 2**20
PEER_TIMEOUT_S = 600


class FrontServer(ThreadingHTTPServer):
    daemon_threads = True
    # A burst of hundreds of connections must wait in the kernel's backlog, not be refused.
    request_queue_size = 1024

    def __init__(self, address, handler, service):
        self.service = service
        super().__init__(address, handler)


def make_http_server(service) -> FrontServer:
    return FrontServer((service.config.host, service.config.port), FrontHandler, service)


class _ClientGone(Exception):
    """The client closed its connection while the answer was being written."""


class FrontHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "gemmactl"

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
        except (Saturated, Unavailable) as exc:
            if not self.headers.get(FORWARDED_HEADER) and self._forward(routed.tier, path, raw, lane):
                return
            self._json(503, api.error_body(exc.message, "overloaded_error" if isinstance(exc, Saturated)
                                           else "unavailable_error", 503), {"Retry-After": str(RETRY_AFTER_S)})
        except _ClientGone:
            log.debug("client went away during a %s request", routed.tier)

    def _generate(self, routed: api.Routed, lane) -> None:
        session = lane.backend.session()
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
        try:
            for event in _chain(first, events):
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
        try:
            for event in _chain(first, events):
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


def _chain(first, events):
    if first is not None:
        yield first
    yield from events
