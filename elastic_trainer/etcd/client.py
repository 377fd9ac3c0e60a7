"""One etcd v3 connection for the rendezvous: connect fast, retry what is transient.

Everything of the rendezvous that speaks to etcd (the backend, the store, the lease
keeper, the fence) goes through an ``EtcdConnection``:

* ``connect`` fails within ``connect_timeout`` seconds with one clear
  ``RendezvousConnectionError`` sentence when no endpoint answers;
* ``call(fn)`` runs ``fn(client)`` and retries gRPC errors that mean "etcd is away for
  a moment" (UNAVAILABLE, DEADLINE_EXCEEDED, no endpoint left) with exponential
  backoff for up to ``retry_timeout`` seconds, so that an etcd restarting with the same
  data dir does not kill a job; an expired auth token is renewed by reconnecting.

Several endpoints (the members of one etcd cluster) are tried in the order given; one that
fails (refused, or no answer within the timeout: a stopped process, a lost node's address) is
avoided for ``_AVOID_FAILED_S`` while another has not failed, so a client pays one timeout per
lost member, not one per request (python3-etcd3's own failover went back to the first endpoint
in its list once a short retry time passed, and refused every endpoint once all had failed).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import etcd3
import etcd3.exceptions
import grpc
from etcd3 import etcdrpc
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from elastic_trainer.observability import metrics
from elastic_trainer.runtime import runtime

logger = logging.getLogger(__name__)

T = TypeVar("T")

_TRANSIENT = (etcd3.exceptions.ConnectionFailedError, etcd3.exceptions.ConnectionTimeoutError,
              etcd3.exceptions.NoServerAvailableError)
_TRANSIENT_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
# What python3-etcd3 counts as a failed endpoint (its _FAILED_EP_CODES).
_FAILED_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL}
# Reconnect within a second once etcd is back (gRPC's default backoff grows to 120 s). gRPC also
# takes min_reconnect_backoff as the deadline of one connection attempt (until etcd's HTTP/2
# SETTINGS frame arrives): at 100 ms an etcd 0.5 s away was never reached at all; a refused
# connection still fails at once, so the pace of reconnects is unchanged.
_GRPC_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 5000),
                 ("grpc.max_reconnect_backoff_ms", 1000)]


# How long an endpoint that failed is passed over while another endpoint has not failed.
_AVOID_FAILED_S = 30.0


class _FailoverClient(etcd3.MultiEndpointEtcd3Client):
    """python3-etcd3's client, starting at the first endpoint and failing over to the endpoint
    that failed longest ago (one that never failed first); never "no server available" while an
    endpoint is configured: when all have failed, the oldest failure is tried again.

    A failure counts against the endpoint the request was sent to (``sending_to``), not the one
    in use when it ended: a request that waited out its timeout on a member that is gone must not
    fail the member the client has moved to since (the library's way sent the client back to the
    lost member, and every request waited there again).
    """

    def __init__(self, *args, **kwargs) -> None:
        self._sent = threading.local()
        super().__init__(*args, **kwargs)
        self._current_endpoint_label = next(iter(self.endpoints))

    @property
    def channel(self) -> grpc.Channel:
        current = self.endpoint_in_use
        if current is None or current.is_failed():
            label = min(self.endpoints, key=lambda name: self.endpoints[name].last_failed)
            if label != self._current_endpoint_label:
                logger.info("etcd: endpoint %s failed; using %s", self._current_endpoint_label, label)
            self._current_endpoint_label = label
            current = self.endpoints[label]
            current.last_failed = 0
        return current.use()

    def next_endpoint(self) -> str:
        """The endpoint the next request goes to (switching now when the one in use failed)."""
        self.channel  # noqa: B018 - the property makes the switch
        return self._current_endpoint_label

    def sending_to(self, label: str | None) -> None:
        """Say, for this thread, which endpoint the requests it sends now go to (None: forget)."""
        self._sent.label = label

    def error_of(self, exc: grpc.RpcError, sent_to: str | None) -> BaseException:
        """python3-etcd3's exception for ``exc``, the failure of a request sent to ``sent_to``, with
        its fail-over applied (as its own calls do: the endpoint marked failed); call it while
        handling ``exc`` (an ``except`` block: the library re-raises what it does not translate)."""
        self.sending_to(sent_to)
        try:
            self._manage_grpc_errors(exc)
        except Exception as translated:  # noqa: BLE001 - the translation is the answer
            return translated
        return exc

    def give_up_endpoint(self, label: str | None = None) -> None:
        """Mark ``label`` (default: the endpoint in use) failed: a request of ours timed out there.
        The next request goes to the endpoint that failed longest ago."""
        label = label or self._current_endpoint_label
        self.endpoints[label].fail()
        if label == self._current_endpoint_label:
            self._clear_old_stubs()

    def txns(self, requests: list[etcdrpc.TxnRequest]) -> list[etcdrpc.TxnResponse]:
        """Raw etcd transactions, all sent at once (one round trip), their answers in order. For
        what python3-etcd3's ``transaction`` cannot say (range options: keys only) or costs too
        much (it wraps every key in a Python object: half of a read of 8,000 keys); errors as
        its calls raise them, the endpoint marked failed (fail-over)."""
        try:
            futures = [self.kvstub.Txn.future(r, self.timeout, credentials=self.call_credentials,
                                              metadata=self.metadata) for r in requests]
            return [f.result() for f in futures]
        except grpc.RpcError as exc:
            self._manage_grpc_errors(exc)  # raises etcd3's exception
            raise

    def _manage_grpc_errors(self, exc: grpc.RpcError):
        current = self.endpoint_in_use
        last_failed = current.last_failed
        sent_to = getattr(self._sent, "label", None) or self._current_endpoint_label
        try:
            super()._manage_grpc_errors(exc)  # marks the current endpoint failed, raises its exception
        finally:
            # "etcdserver: no leader", "etcdserver: request timed out": the member answered (an
            # election is under way) and is not avoided. A request sent to another endpoint than
            # the current one fails that endpoint, not the current one.
            answered = str(exc.details() or "").startswith("etcdserver:")
            if answered or sent_to != self._current_endpoint_label:
                current.last_failed = last_failed
            if not answered and sent_to != self._current_endpoint_label and exc.code() in _FAILED_CODES:
                self.endpoints[sent_to].fail()


@dataclass(frozen=True)
class EtcdOptions:
    """How to reach etcd (see docs/rendezvous.md for each option)."""

    endpoints: tuple[tuple[str, int], ...]
    protocol: str = "http"
    user: str | None = None
    password: str | None = field(default=None, repr=False)  # never in a repr, a log line or a traceback
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    read_timeout: float = 10.0
    connect_timeout: float = 4.0
    retry_timeout: float = 60.0

    @property
    def endpoint_text(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)


def export_options(options: EtcdOptions, password_file: str | None) -> str:
    """How a worker reaches etcd, as JSON for its environment: everything but the password, which
    stays in ``password_file`` (a 0600 file), so that it is in no process's environment."""
    o = options
    if o.password and not password_file:
        raise ValueError("the etcd password must travel to workers in a file, not in their environment")
    return json.dumps({"endpoints": o.endpoint_text, "protocol": o.protocol, "user": o.user,
                       "password_file": password_file if o.password else None,
                       "ca_cert": o.ca_cert, "cert": o.cert, "key": o.key})


def options_from_export(text: str, retry_timeout: float = 15.0, endpoints: str | None = None) -> EtcdOptions:
    """The ``EtcdOptions`` a worker got from ``export_options`` (the password read from its file)."""
    conn = json.loads(text or "{}")
    password = None
    if conn.get("password_file"):
        with open(conn["password_file"]) as f:
            password = f.read().rstrip("\r\n")
    return EtcdOptions(endpoints=parse_endpoints(endpoints or conn.get("endpoints") or ""),
                       protocol=conn.get("protocol") or "http", user=conn.get("user"), password=password,
                       ca_cert=conn.get("ca_cert"), cert=conn.get("cert"), key=conn.get("key"),
                       retry_timeout=retry_timeout)


def parse_endpoints(text: str) -> tuple[tuple[str, int], ...]:
    """``host:port[,host:port]`` (an http(s):// prefix and a missing port, 2379, are allowed)."""
    out = []
    for item in (text or "").split(","):
        item = item.strip()
        for scheme in ("http://", "https://"):
            if item.startswith(scheme):
                item = item[len(scheme):]
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, "2379"
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"the rendezvous endpoint {item!r} is not host:port (for example 127.0.0.1:2379)")
        out.append((host.strip("[]"), int(port)))
    if not out:
        raise ValueError("the rendezvous endpoint is empty; pass --rdzv-endpoint HOST:PORT of an etcd")
    return tuple(out)


_OPS = (("lease grant", "lease_grant"), ("revoke", "lease_revoke"), ("keep-alive", "other"),
        ("time-to-live", "other"), ("watch", "watch"), ("delete", "delete"), ("remove", "delete"),
        ("compare", "txn"), ("commit", "txn"), ("fence", "txn"), ("stall", "txn"), ("ranks write", "txn"),
        ("txn", "txn"), ("read", "get"), ("get", "get"), ("list", "get"), ("earlier keys", "get"), ("put", "put"),
        ("write", "put"), ("alive key", "put"))


def op_of(what: str) -> str:
    """The ``op`` label (``metrics.ETCD_OPS``) of a request that ``EtcdConnection.call`` names ``what``
    (``"live quorum compare-and-swap"`` -> ``txn``); ``other`` when none fits."""
    text = what.lower()
    return next((op for word, op in _OPS if word in text), "other")


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, _TRANSIENT):
        return True
    if isinstance(exc, ValueError) and "failed node" in str(exc):
        return True  # python3-etcd3's "Trying to use a failed node"
    if isinstance(exc, grpc.RpcError):
        # etcd answers an overloaded stream with UNKNOWN "context deadline exceeded".
        return exc.code() in _TRANSIENT_CODES or "deadline exceeded" in str(exc.details() or "")
    return False


def _is_auth_expired(exc: BaseException) -> bool:
    return isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNAUTHENTICATED


class _Pending:
    """One renewal sent on a keep-alive stream, waiting for its answer."""

    __slots__ = ("done", "ttl", "error", "sent", "answered", "stream", "callback", "applied")

    def __init__(self, stream: _KeepAliveStream) -> None:
        self.done = threading.Event()
        self.ttl: int | None = None
        self.error: BaseException | None = None
        self.sent = time.monotonic()
        self.answered: float | None = None
        self.stream = stream
        self.callback: Callable[[_Pending], bool] | None = None
        self.applied = False
        """True once ``callback`` took the answer (so that whoever reads it later does not apply it again)."""

    def on_answer(self, callback: Callable[[_Pending], bool]) -> None:
        """Have ``callback(self)`` called with etcd's answer as soon as it arrives, by the stream's
        reader thread (at once, here, if it already came); it returns True when it applied the
        answer (``applied``). It must be quick: the stream's other answers wait behind it."""
        if self.stream.hold_for_answer(self, callback):
            return
        if self.error is None and callback(self):
            self.applied = True


class _KeepAliveStream:
    """One ``LeaseKeepAlive`` stream that renews every lease of a connection.

    python3-etcd3's ``refresh_lease`` opens a new bidirectional gRPC stream for every
    renewal, and gRPC starts a thread to feed each stream's requests: a thousand agents
    renewing leases spent most of their CPU creating streams and threads, and their leases
    expired. etcd answers the renewals of one stream in order, per lease, so here one
    long-lived stream carries them all (as etcd's Go client does): a renewal is one small
    message. A stream that fails, or leaves a renewal unanswered for ``timeout`` seconds,
    is cancelled, and its pending renewals fail with the cause; the next renewal opens a
    new stream.
    """

    def __init__(self, client: _FailoverClient, timeout: float) -> None:
        self.client = client
        self._timeout = timeout
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: dict[int, collections.deque[_Pending]] = {}
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self.endpoint = client.next_endpoint()  # where this stream's renewals go
        self._call = client.leasestub.LeaseKeepAlive(self._feed(), credentials=client.call_credentials,
                                                     metadata=client.metadata)
        # This process's runtime owns the reader (the agent's, or a worker's); it ends with the stream.
        runtime().start_thread("etcd-lease-keepalive", self._read, stop=self.close)

    @property
    def closed(self) -> bool:
        return self._error is not None

    def _feed(self) -> Iterator[etcdrpc.LeaseKeepAliveRequest]:
        while (request := self._requests.get()) is not None:
            yield request

    def _read(self) -> None:
        error: BaseException
        try:
            for response in self._call:
                with self._lock:
                    waiting = self._pending.get(response.ID)
                    pending = waiting.popleft() if waiting else None
                    if waiting is not None and not waiting:
                        del self._pending[response.ID]
                    if pending is not None:
                        pending.ttl, pending.answered = response.TTL, time.monotonic()
                if pending is not None:
                    if pending.callback is not None:  # before ``done``: a waiter sees the answer applied
                        try:
                            pending.applied = pending.callback(pending)
                        except Exception:  # noqa: BLE001 - the answer is applied by its next reader instead
                            logger.exception("applying a lease renewal's answer failed")
                    pending.done.set()
            error = etcd3.exceptions.ConnectionFailedError("etcd closed the lease keep-alive stream")
        except grpc.RpcError as exc:
            error = exc
            if not self.closed:  # not our own cancel: python3-etcd3's exception, and its failover
                error = self.client.error_of(exc, self.endpoint)
        self._fail(error)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
            pending, self._pending = self._pending, {}
        self._requests.put(None)
        self._call.cancel()
        for waiting in pending.values():
            for p in waiting:
                p.error = self._error
                p.done.set()

    def hold_for_answer(self, p: _Pending, callback: Callable[[_Pending], bool]) -> bool:
        """Keep ``callback`` on ``p`` for the reader thread to call with etcd's answer; False when
        the answer (or the stream's error) came already, and the caller applies it itself."""
        with self._lock:
            if p.answered is None and p.error is None:
                p.callback = callback
                return True
        return False

    def send(self, lease_id: int) -> _Pending:
        """Send one renewal of ``lease_id``; its answer comes in the returned ``_Pending``."""
        p = _Pending(self)
        with self._lock:
            if self._error is not None:
                raise self._error
            self._pending.setdefault(lease_id, collections.deque()).append(p)
        self._requests.put(etcdrpc.LeaseKeepAliveRequest(ID=lease_id))
        return p

    def result(self, p: _Pending, wait: float, give_up_after: float | None = None) -> int | None:
        """The TTL etcd answered to ``p`` (<= 0: it no longer knows the lease), waiting up to ``wait``
        seconds for it; None while it is unanswered for less than ``give_up_after`` seconds (default:
        the stream's timeout). One unanswered that long fails the stream and marks its endpoint
        failed, so that the next renewal goes to another endpoint when there is one."""
        give_up_after = self._timeout if give_up_after is None else give_up_after
        left = p.sent + give_up_after - time.monotonic()
        if not p.done.wait(max(0.0, min(wait, left))):
            if time.monotonic() - p.sent < give_up_after:
                return None
            self.client.give_up_endpoint(self.endpoint)  # our own cancel below does not tell python3-etcd3
            self._fail(etcd3.exceptions.ConnectionTimeoutError(
                f"etcd did not answer a lease renewal within {give_up_after:g}s"))
        if p.error is not None:
            raise p.error
        return int(p.ttl)  # type: ignore[arg-type]

    def renew(self, lease_id: int, timeout: float | None = None) -> int:
        """Renew ``lease_id`` once and wait for the answer (``send`` then ``result``)."""
        timeout = self._timeout if timeout is None else timeout
        return self.result(self.send(lease_id), timeout, timeout)  # type: ignore[return-value]

    def close(self) -> None:
        self._fail(etcd3.exceptions.ConnectionFailedError("the lease keep-alive stream was closed"))


class EtcdConnection:
    """A python3-etcd3 client with fast failure at start and bounded retries after."""

    def __init__(self, options: EtcdOptions) -> None:
        self.options = options
        self._lock = threading.Lock()
        self._client = self._connect()
        self._keepalive: _KeepAliveStream | None = None

    # -- construction -------------------------------------------------------------------
    def _make_client(self, timeout: float) -> etcd3.MultiEndpointEtcd3Client:
        o = self.options
        secure = o.protocol == "https" or o.ca_cert is not None
        creds = None
        if secure:
            def read(path):
                if path is None:
                    return None
                with open(path, "rb") as f:
                    return f.read()
            try:
                creds = grpc.ssl_channel_credentials(read(o.ca_cert), read(o.key), read(o.cert))
            except OSError as exc:
                raise RendezvousConnectionError(
                    f"cannot read the etcd TLS files (ca_cert={o.ca_cert}, cert={o.cert}, key={o.key}): "
                    f"{exc}; fix the paths in --rdzv-conf") from exc
        endpoints = [etcd3.Endpoint(h, p, secure=secure, creds=creds, time_retry=_AVOID_FAILED_S,
                                   opts=_GRPC_OPTIONS)
                     for h, p in o.endpoints]
        try:
            client = _FailoverClient(endpoints=endpoints, timeout=timeout, user=o.user,
                                     password=o.password, failover=True)
            if not secure:
                # gRPC sends call credentials only over TLS; the token also travels as metadata.
                client.call_credentials = None
            return client
        except grpc.RpcError as exc:  # authentication happens in the constructor
            raise self._connection_error(exc) from exc
        except Exception as exc:  # noqa: BLE001 - python3-etcd3 raises bare Exception for half credentials
            raise RendezvousConnectionError(f"cannot connect to etcd at {o.endpoint_text}: {exc}") from exc

    def _connection_error(self, exc: BaseException) -> RendezvousConnectionError:
        o = self.options
        detail = exc.details() if isinstance(exc, grpc.RpcError) else (str(exc) or type(exc).__name__)
        if _is_auth_expired(exc) or "authentication" in str(detail).lower() or "auth" in str(detail).lower():
            hint = "check the user and password in --rdzv-conf"
        else:
            hint = "check --rdzv-endpoint, that etcd runs, and the TLS options (protocol, ca_cert, cert, key)"
        return RendezvousConnectionError(
            f"etcd at {o.endpoint_text} did not answer within {o.connect_timeout:g}s ({detail}); {hint}")

    def _connect(self) -> etcd3.MultiEndpointEtcd3Client:
        # Authenticate and ask for etcd's status until it answers or connect_timeout passes
        # (a server that is starting refuses connections for a moment). One status request may
        # take a share of the budget, so that an endpoint that does not answer at all leaves
        # time for the next one.
        deadline = time.monotonic() + self.options.connect_timeout
        share = self.options.connect_timeout / len(self.options.endpoints)
        client = None
        while True:
            try:
                if client is None:
                    client = self._make_client(max(0.5, deadline - time.monotonic()))
                client.timeout = max(0.5, min(share, deadline - time.monotonic()))
                client.status()
                client.timeout = self.options.read_timeout
                return client
            except Exception as exc:  # noqa: BLE001 - every failure at start becomes one sentence
                cause = exc.__cause__ if isinstance(exc, RendezvousConnectionError) else exc
                if client is not None and not (_is_transient(cause) and time.monotonic() + 0.2 < deadline):
                    client.close()
                    client = None
                if _is_transient(cause) and time.monotonic() + 0.2 < deadline:
                    time.sleep(0.2)
                    continue
                if isinstance(exc, RendezvousConnectionError):
                    raise
                raise self._connection_error(exc) from exc

    # -- use ----------------------------------------------------------------------------
    @property
    def client(self) -> etcd3.MultiEndpointEtcd3Client:
        return self._client

    def call(self, fn: Callable[[etcd3.MultiEndpointEtcd3Client], T], what: str = "request",
             retry_timeout: float | None = None) -> T:
        """Run ``fn(client)``; retry transient failures for up to ``retry_timeout`` seconds."""
        budget = self.options.retry_timeout if retry_timeout is None else retry_timeout
        deadline = time.monotonic() + budget
        delay = 0.05
        while True:
            client = self._client
            try:
                client.sending_to(client.next_endpoint())
                sent = time.perf_counter()
                try:
                    return fn(client)
                finally:
                    client.sending_to(None)
                    metrics.etcd_request(op_of(what), time.perf_counter() - sent)  # /metrics; a no-op without
            except Exception as exc:  # noqa: BLE001 - classified below, re-raised when not transient
                if _is_auth_expired(exc) and self.options.user:
                    self._reconnect(client)
                    if time.monotonic() < deadline:
                        continue
                if not _is_transient(exc):
                    raise
                if time.monotonic() + delay > deadline:
                    raise RendezvousConnectionError(
                        f"etcd at {self.options.endpoint_text} has not answered the rendezvous {what} "
                        f"for {budget:g}s ({type(exc).__name__}); is etcd running?") from exc
                logger.log(logging.WARNING if delay == 0.05 else logging.DEBUG,
                           "etcd %s failed (%s); retrying for up to %gs", what, type(exc).__name__, budget)
                time.sleep(delay * random.uniform(0.8, 1.2))
                delay = min(delay * 2, 1.0)

    def _reconnect(self, old: etcd3.MultiEndpointEtcd3Client) -> None:
        with self._lock:
            if self._client is not old:
                return
            logger.info("renewing the etcd auth token of %s", self.options.user)
            try:
                new = self._make_client(self.options.read_timeout)
                new.timeout = self.options.read_timeout
            except RendezvousConnectionError:
                return
            self._client = new
        old.close()

    def renew_lease(self, lease_id: int, failover_after: float | None = None) -> int:
        """Renew a lease once on this connection's shared keep-alive stream; its remaining TTL
        (<= 0 when etcd no longer knows it). Errors are raised as ``call`` classifies them.

        ``failover_after``: with several endpoints, give up on the one in use after this many
        seconds (and use another from the next renewal on) instead of the read timeout: a lease
        that must be renewed within seconds cannot wait out a member that hangs. With one
        endpoint there is nowhere else to go, and a slow etcd is waited for."""
        return self._stream().renew(lease_id, self._renewal_timeout(failover_after))

    def send_renewal(self, lease_id: int) -> _Pending:
        """Send one renewal of a lease on the shared keep-alive stream without waiting for the
        answer; read it with ``renewal_result``. A keeper that waits for each answer before it
        sends the next renews late whenever answers are late: at 1,000 simulated agents on two
        CPUs answers took seconds to reach their threads, and the renewals, held back, came after
        the 3 s leases had run out although etcd answered each in a millisecond."""
        return self._stream().send(lease_id)

    def renewal_result(self, pending: _Pending, wait: float, failover_after: float | None = None) -> int | None:
        """The TTL etcd answered to a ``send_renewal`` (<= 0: the lease is gone), waiting up to
        ``wait`` seconds; None while unanswered. ``failover_after`` as in ``renew_lease``: a renewal
        unanswered that long (the read timeout with one endpoint) fails its stream and raises."""
        return pending.stream.result(pending, wait, self._renewal_timeout(failover_after))

    def renewal_give_up_after(self, failover_after: float) -> float:
        """Seconds after which ``renewal_result`` gives up an unanswered renewal (and fails its stream)."""
        timeout = self._renewal_timeout(failover_after)
        return self.options.read_timeout if timeout is None else timeout

    def _renewal_timeout(self, failover_after: float | None) -> float | None:
        return failover_after if failover_after is not None and len(self.options.endpoints) > 1 else None

    def _stream(self) -> _KeepAliveStream:
        with self._lock:
            stream = self._keepalive
            if stream is None or stream.closed or stream.client is not self._client:
                if stream is not None:
                    stream.close()
                stream = self._keepalive = _KeepAliveStream(self._client, self.options.read_timeout)
        return stream

    def close(self) -> None:
        with self._lock:
            stream, self._keepalive = self._keepalive, None
        if stream is not None:
            stream.close()
        self._client.close()
