"""A KV store reachable over the network: `StoreServer` serves a local store, `RemoteStore` is its client.

Why: the embedded store lives in one process, but store-and-pull needs prefill (one datacenter)
to land frames where decode (another) pulls them.  The intended deployment: the decode instance
hosts an `EmbeddedStore` and a `StoreServer` on its KV port; prefill pushes with
`StorePushSender(RemoteStore(decode_kv_address))`; decode pulls locally with
`StorePullReceiver(embedded_store)`, woken by the store's watch as the server's puts land.  TLS
(mutual, with `crossfill.kv.tls` contexts) protects the link like the other data-plane backends.

Protocol (one request, one answer, in order, on each connection; integers big-endian):

    request : magic "CXST", version u8 (1), op u8, tenant_len u16, key_len u16, ttl_s f64 (NaN: the
              store's default), data_len u64, then tenant, key (UTF-8) and data
    answer  : magic "CXST", version u8 (1), status u8, body_len u64, then the body
    ops     : 1 put, 2 get, 3 delete, 4 exists, 5 stats
    status  : 0 OK (get: the value; stats: JSON; put/delete/exists: True), 1 NONE (get: absent;
              delete/exists: False), 2 ERROR (JSON {"error": class name, "message": text})

The server bounds every length before reading or allocating (`max_object_bytes`, keys and
tenants as the stores allow); a refused or malformed request gets an ERROR answer and is counted
(`counters()`), and a stream it cannot read on from (bad magic, oversized body) is closed after
the answer.  It never crashes on what a client sends.  The client is synchronous and
thread-safe, as the KVStore interface requires (the push sender calls it from worker threads):
each call takes an idle connection from a small pool or opens one, reconnects once when a pooled
connection turns out dead, and raises StoreUnavailableError naming the address when it cannot
reach the server.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import socket
import ssl
import struct
import threading
from dataclasses import asdict

from crossfill.kv.listener import Listener, Listens
from crossfill.kv.sender import parse_endpoint
from crossfill.kv.store import base
from crossfill.kv.store.base import DEFAULT_TENANT, KVStore, StoreError, StoreStats, StoreUnavailableError

MAGIC = b"CXST"
VERSION = 1
_REQ = struct.Struct("!4sBBHHdQ")
_RESP = struct.Struct("!4sBBQ")
PUT, GET, DELETE, EXISTS, STATS = 1, 2, 3, 4, 5
OK, NONE, ERROR = 0, 1, 2
DEFAULT_MAX_OBJECT_BYTES = 256 << 20
_MAX_TENANT_BYTES = 64
_MAX_KEY_BYTES = 4 * base.MAX_KEY_CHARS  # UTF-8
_MAX_ANSWER_TEXT = 64 << 10
_ERRORS: dict[str, type[StoreError]] = {
    cls.__name__: cls for cls in (base.InvalidKeyError, base.InvalidArgumentError, base.ObjectTooLargeError, StoreUnavailableError)
}


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Refused(Exception):  # noqa: N818 - a request the server answers with ERROR
    def __init__(self, kind: str, message: str, fatal: bool) -> None:
        super().__init__(message)
        self.kind = kind  # counter suffix: malformed, oversized
        self.fatal = fatal  # the stream cannot be read on from: close it after answering


# =============================================================================================
# server
# =============================================================================================

class StoreServer(Listens):
    """Serves put/get/delete/exists/stats of a local `store` on (host, port), optionally over TLS."""

    def __init__(self, store: KVStore, host: str = "127.0.0.1", port: int = 0, *,
                 tls: ssl.SSLContext | None = None, max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES) -> None:
        self.store = store
        self.listener = Listener(host, port, tls)
        self.max_object_bytes = max_object_bytes
        self._counters: collections.Counter[str] = collections.Counter()

    async def start(self) -> StoreServer:
        await self.listener.start_streams(self._serve)
        return self

    async def close(self) -> None:
        await self.listener.close()

    async def __aenter__(self) -> StoreServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


    def counters(self) -> dict[str, int]:
        """requests, answers by status, refused_<malformed|oversized>, errors_<store error class>."""
        return dict(self._counters)

    # -- one connection -------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with self.listener.handling():
            try:
                await self._answer_requests(reader, writer)
            except (ConnectionError, OSError, asyncio.IncompleteReadError, ssl.SSLError):
                pass  # the client reconnects
            except asyncio.CancelledError:
                pass  # close(): end quietly (asyncio's stream callback reports a cancelled handler as an error)
            finally:
                writer.close()

    async def _answer_requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readexactly(_REQ.size)
            except asyncio.IncompleteReadError:
                return  # the client hung up between requests
            try:
                status, body = await self._request(reader, head)
            except _Refused as exc:
                self._counters[f"refused_{exc.kind}"] += 1
                await _answer(writer, ERROR, _error_body("base.InvalidArgumentError", str(exc)))
                if exc.fatal:
                    return
                continue
            self._counters[f"answers_{('ok', 'none', 'error')[status]}"] += 1
            await _answer(writer, status, body)

    async def _request(self, reader: asyncio.StreamReader, head: bytes) -> tuple[int, bytes]:
        magic, version, op, tenant_len, key_len, ttl, data_len = _REQ.unpack(head)
        self._counters["requests"] += 1
        if magic != MAGIC or version != VERSION:
            raise _Refused("malformed", f"not a crossfill store request (magic {magic!r}, version {version})", True)
        if tenant_len > _MAX_TENANT_BYTES or key_len > _MAX_KEY_BYTES or data_len > self.max_object_bytes:
            raise _Refused("oversized", f"request of tenant {tenant_len} B, key {key_len} B, data {data_len} B "
                           f"exceeds the limits ({_MAX_TENANT_BYTES}, {_MAX_KEY_BYTES}, {self.max_object_bytes})",
                           True)
        if op != PUT and data_len:
            raise _Refused("malformed", f"operation {op} carries no data, got {data_len} bytes", True)
        raw = await reader.readexactly(tenant_len + key_len + data_len)
        try:
            tenant = raw[:tenant_len].decode()
            key = raw[tenant_len:tenant_len + key_len].decode()
        except UnicodeDecodeError as exc:
            raise _Refused("malformed", f"tenant or key is not UTF-8: {exc}", False) from exc
        try:
            return await asyncio.to_thread(self._apply, op, tenant, key, raw[tenant_len + key_len:], ttl)
        except StoreError as exc:
            self._counters[f"errors_{type(exc).__name__}"] += 1
            return ERROR, _error_body(type(exc).__name__, str(exc))
        except Exception as exc:  # a store bug: the client gets an error, the server keeps serving
            self._counters["errors_internal"] += 1
            return ERROR, _error_body("StoreError", f"internal error: {type(exc).__name__}: {exc}")

    def _apply(self, op: int, tenant: str, key: str, data: bytes, ttl: float) -> tuple[int, bytes]:
        s = self.store
        if op == PUT:
            s.put(key, data, None if math.isnan(ttl) else ttl, tenant)
            return OK, b""
        if op == GET:
            value = s.get(key, tenant)
            return (NONE, b"") if value is None else (OK, value)
        if op == DELETE:
            return (OK if s.delete(key, tenant) else NONE), b""
        if op == EXISTS:
            return (OK if s.exists(key, tenant) else NONE), b""
        if op == STATS:
            return OK, json.dumps(asdict(s.stats())).encode()
        raise base.InvalidArgumentError(f"unknown store operation {op}")


async def _answer(writer: asyncio.StreamWriter, status: int, body: bytes) -> None:
    writer.write(_RESP.pack(MAGIC, VERSION, status, len(body)) + body)
    await writer.drain()


def _error_body(kind: str, message: str) -> bytes:
    return json.dumps({"error": kind, "message": message[:_MAX_ANSWER_TEXT // 2]}).encode()


# =============================================================================================
# client
# =============================================================================================

class RemoteStore:
    """A `KVStore` whose objects live in a `StoreServer` at `address` ('host:port' or (host, port)).

    Thread-safe; keeps up to `pool_size` idle connections.  `timeout_s` bounds connecting and
    each request.  `tls`: a client context (crossfill.kv.tls.client_context) for mutual TLS.
    """

    def __init__(self, address: str | tuple[str, int], *, tls: ssl.SSLContext | None = None,
                 server_hostname: str | None = None, timeout_s: float = 8.0, pool_size: int = 8,
                 max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES) -> None:
        self.host, self.port = parse_endpoint(address)
        self.tls = tls
        self.server_hostname = server_hostname or self.host
        self.timeout_s = timeout_s
        self.pool_size = pool_size
        self.max_object_bytes = max_object_bytes
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False

    @property
    def address(self) -> str:
        return _address(self.host, self.port)

    # -- KVStore --------------------------------------------------------------------------
    def put(self, key: str, data: bytes, ttl_s: float | None = None, tenant: str = DEFAULT_TENANT) -> None:
        base.check_ttl(ttl_s)
        if len(data) > self.max_object_bytes:
            raise base.ObjectTooLargeError(f"object of {len(data)} bytes exceeds the remote store's limit of "
                                      f"{self.max_object_bytes} per request")
        self._call(PUT, key, tenant, bytes(data), math.nan if ttl_s is None else float(ttl_s))

    def get(self, key: str, tenant: str = DEFAULT_TENANT) -> bytes | None:
        status, body = self._call(GET, key, tenant)
        return body if status == OK else None

    def delete(self, key: str, tenant: str = DEFAULT_TENANT) -> bool:
        return self._call(DELETE, key, tenant)[0] == OK

    def exists(self, key: str, tenant: str = DEFAULT_TENANT) -> bool:
        return self._call(EXISTS, key, tenant)[0] == OK

    def stats(self) -> StoreStats:
        return StoreStats(**json.loads(self._call(STATS, "", DEFAULT_TENANT)[1]))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> RemoteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests -------------------------------------------------------------------------
    def _call(self, op: int, key: str, tenant: str, data: bytes = b"", ttl: float = math.nan) -> tuple[int, bytes]:
        if op != STATS:
            base.check_key(key)
        base.check_tenant(tenant)
        t, k = tenant.encode(), key.encode()
        request = [_REQ.pack(MAGIC, VERSION, op, len(t), len(k), ttl, len(data)), t, k]
        for attempt in range(2):
            sock, pooled = self._connection()
            try:
                status, body = self._exchange(sock, request, data)
            except (OSError, EOFError) as exc:
                with contextlib.suppress(OSError):
                    sock.close()
                if pooled and attempt == 0:
                    continue  # an idle connection the server (or a middlebox) closed: reconnect once
                raise StoreUnavailableError(f"KV store at {self.address}: request failed: "
                                            f"{type(exc).__name__}: {exc}") from exc
            self._release(sock)
            if status == ERROR:
                raise _error_from(body, self.address)
            return status, body
        raise AssertionError("unreachable")

    def _connection(self) -> tuple[socket.socket, bool]:
        with self._lock:
            if self._closed:
                raise StoreError(f"the remote store client for {self.address} is closed")
            if self._idle:
                return self._idle.pop(), True
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
        except OSError as exc:
            raise StoreUnavailableError(f"cannot connect to the KV store at {self.address}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tls is not None:
            try:
                sock = self.tls.wrap_socket(sock, server_hostname=self.server_hostname)
            except (OSError, ssl.SSLError) as exc:
                sock.close()
                raise StoreUnavailableError(f"TLS with the KV store at {self.address} failed: {exc}") from exc
        return sock, False

    def _release(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.pool_size:
                self._idle.append(sock)
                return
        sock.close()

    def _exchange(self, sock: socket.socket, request: list[bytes], data: bytes) -> tuple[int, bytes]:
        sock.sendall(b"".join(request))
        if data:
            sock.sendall(data)
        magic, version, status, body_len = _RESP.unpack(_recv_exactly(sock, _RESP.size))
        if magic != MAGIC or version != VERSION or status not in (OK, NONE, ERROR):
            raise OSError(f"not a crossfill store answer (magic {magic!r}, version {version}, status {status})")
        limit = self.max_object_bytes if status == OK else _MAX_ANSWER_TEXT
        if body_len > limit:
            raise OSError(f"answer of {body_len} bytes exceeds {limit}")
        return status, _recv_exactly(sock, body_len)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def _error_from(body: bytes, address: str) -> StoreError:
    try:
        info = json.loads(body)
        kind, message = str(info["error"]), str(info["message"])
    except (ValueError, KeyError, TypeError):
        return StoreError(f"KV store at {address} refused the request: {body[:200]!r}")
    return _ERRORS.get(kind, StoreError)(f"KV store at {address}: {message}")


__all__ = ["RemoteStore", "StoreServer"]
