"""Fleets: at most N hosts of a group restarting at once, through etcd leases.

The bare-metal counterpart of a PodDisruptionBudget. Before a restart the daemon takes one of
``max_concurrent`` slots of its group in etcd, and gives it back once the restarted vLLM is
verified ready (or the restart is abandoned). The slots are keys ``PREFIX/GROUP/slot-<i>``,
each taken by a transaction "if the key does not exist (create_revision == 0), put it with my
lease", so two hosts can never hold one slot. The key carries an etcd lease of ``lease_ttl``
seconds, kept alive by a thread every third of the TTL while the restart runs, and revoked at
the end, which deletes the key at once. A host that dies holding a slot stops renewing, and
etcd deletes the key when the lease expires: no stale lock survives its owner by more than the
TTL (kured's lock, an annotation with an optional TTL, could: kured #822, #137). When no slot
is free the restart waits for a later tick; when etcd does not answer, ``on_unreachable``
decides: ``hold`` (fail closed: no restart) or ``emergency-only``.

Each host also publishes an entry of its own, ``PREFIX/GROUP/hosts/NAME``, a digest of its
status (``fleet_view.HostEntry``) for ``vkvagent fleet status``: at once when what it says
changes (its verdict, vLLM's version, its last action), else every ``PUBLISH_EVERY`` seconds,
two requests (a keepalive of the entry's lease, a put). Each put is a revision etcd keeps
until it compacts (off by default), so the entries are not a heartbeat: 1,000 hosts put about
3 a second. The lease lasts ``ENTRY_LEASE`` publishes, so a host gone for good leaves the
group a quarter of an hour after its last. The slots are read apart
(``PREFIX/GROUP/slot-``), so listing them never reads the entries.

The client is a small one on http.client against etcd's v3 JSON gateway (``/v3/...``, served
by every etcd since 3.4 on its client port; keys and values base64), not etcd3gw. etcd3gw is
pure Python too, but it pulls requests (and futurist, urllib3, ...): requests cannot bound a
whole response, only each read, and costs about 6 MB of RSS in a daemon whose target is 40 MB;
vkvagent dropped it from its vLLM client for those reasons (vkvagent/adapters/vllm.py). The protocol
needs six calls (lease grant, keepalive and revoke, a transaction, a range and authenticate),
each one POST of a small JSON body. Here every request has a hard deadline (a watchdog shuts
the socket at ``timeout``, whatever the phase), honours no proxy variables, and fails with one
line (``FleetError``); endpoints are tried in turn, TLS and etcd's user/password auth (the
password read from a file, its token renewed when etcd rejects it) are supported.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import math
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from vkvagent import __version__
from vkvagent.errors import VkvagentError
from vkvagent.knowledge.config import FleetConfig
from vkvagent.knowledge.fleet_view import HostEntry
from vkvagent.knowledge.status import FleetStatus, SlotHolder, StatusReport

MAX_BODY = 1024 * 1024
LIST_EVERY = 30.0  # seconds between two listings of the holders for the status, when idle
# Seconds without asking etcd again after it did not answer (for a slot, the status or what
# the hosts share): a hung etcd costs a tick its timeout once a minute at most, not each tick.
RETRY_AFTER = 60.0
PUBLISH_EVERY = 300.0  # seconds between two puts of this host's entry when it says the same
ENTRY_LEASE = 3  # publishes an entry outlives its host by: it leaves the group after that
ENTRIES_PAGE = 100  # entries a read: about 100 kB, and 550 kB were each as big as one may be
# gRPC codes etcd returns in the gateway's error body
_NOT_FOUND, _UNAVAILABLE, _DEADLINE, _UNAUTHENTICATED = 5, 14, 4, 16


class FleetError(VkvagentError):
    """etcd could not be asked, or refused; the message is one line."""


class EtcdRefused(FleetError):
    """etcd answered with an error (``code``: its gRPC status code)."""

    def __init__(self, message: str, code: int | None) -> None:
        super().__init__(message)
        self.code = code


def _b64(text: str | bytes) -> str:
    data = text.encode("utf-8") if isinstance(text, str) else text
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))


def prefix_end(prefix: str) -> str:
    """The ``range_end`` that makes a range cover every key starting with ``prefix``."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


@dataclass(frozen=True)
class _Endpoint:
    url: str
    https: bool
    host: str
    port: int


class EtcdClient:
    """The calls of etcd's v3 JSON gateway the slot protocol uses; thread-safe (the keepalive
    thread shares it). One short-lived connection per request."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout: float = 2.0,
        ca_file: str = "",
        cert_file: str = "",
        key_file: str = "",
        username: str = "",
        password_file: str = "",
    ) -> None:
        if not endpoints:
            raise FleetError("no etcd endpoints")
        self.endpoints = [_endpoint(url) for url in endpoints]
        self.timeout = timeout
        self._tls = (ca_file, cert_file, key_file)
        self._context: ssl.SSLContext | None = None
        self._username, self._password_file = username, password_file
        self._token: str | None = None
        self._lock = threading.Lock()
        self._current = 0  # the endpoint that answered last: asked first

    # -- the calls ---------------------------------------------------------------------------

    def grant(self, ttl: int) -> tuple[str, int]:
        """A new lease: its ID (etcd's int64, kept as text) and the TTL etcd granted."""
        answer = self.call("lease/grant", {"TTL": str(ttl)})
        if answer.get("error"):
            raise EtcdRefused(f"lease grant refused: {answer['error']}", None)
        with _answer_of("lease/grant"):
            return str(int(answer["ID"])), int(answer.get("TTL", ttl))

    def keepalive(self, lease: str) -> int:
        """Renew a lease; its TTL again, or 0 when the lease no longer exists (expired)."""
        answer = self.call("lease/keepalive", {"ID": lease})
        result = answer.get("result", answer)
        with _answer_of("lease/keepalive"):
            return int(result.get("TTL", 0)) if isinstance(result, dict) else 0

    def revoke(self, lease: str) -> None:
        """End a lease and delete its keys; one that no longer exists is already gone."""
        try:
            self.call("lease/revoke", {"ID": lease})
        except EtcdRefused as exc:
            if exc.code != _NOT_FOUND:
                raise

    def create(self, key: str, value: str, lease: str) -> bool:
        """Put ``key`` with ``lease`` if it does not exist; whether it was put."""
        absent = {"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
        put = {"key": _b64(key), "value": _b64(value), "lease": lease}
        answer = self.call("kv/txn", {"compare": [absent], "success": [{"request_put": put}]})
        return bool(answer.get("succeeded", False))

    def put(self, key: str, value: str, lease: str) -> None:
        """Put ``key`` with ``lease``, whatever it held."""
        self.call("kv/put", {"key": _b64(key), "value": _b64(value), "lease": lease})

    def range_prefix(self, prefix: str, limit: int = 1000, start: str = "") -> list[dict[str, Any]]:
        """The keys under ``prefix`` (from ``start`` on, if given), at most ``limit``: key and
        value decoded, lease and revisions as given."""
        answer = self.call(
            "kv/range",
            {"key": _b64(start or prefix), "range_end": _b64(prefix_end(prefix)),
             "limit": str(limit)},
        )  # fmt: skip
        found = []
        with _answer_of("kv/range"):
            for kv in answer.get("kvs") or []:
                found.append(
                    {
                        "key": _unb64(kv["key"]).decode("utf-8", "replace"),
                        "value": _unb64(kv.get("value", "")).decode("utf-8", "replace"),
                        "lease": str(kv.get("lease", "0")),
                        "create_revision": int(kv.get("create_revision", 0)),
                    }
                )
        return found

    # -- transport ---------------------------------------------------------------------------

    def call(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<path>``, each endpoint in turn from the one that answered
        last, until one answers. Raises FleetError (EtcdRefused when etcd said no)."""
        payload = json.dumps(body).encode("utf-8")
        problems = []
        start = self._current
        for step in range(len(self.endpoints)):
            index = (start + step) % len(self.endpoints)
            endpoint = self.endpoints[index]
            try:
                return self._ask(endpoint, path, payload)
            except EtcdRefused as exc:
                if exc.code not in (_UNAVAILABLE, _DEADLINE):
                    self._current = index
                    raise
                problems.append(f"{endpoint.url}: {exc}")  # no leader, overloaded: next one
            except FleetError as exc:
                problems.append(f"{endpoint.url}: {exc}")
        raise FleetError("etcd unreachable: " + "; ".join(problems))

    def _ask(self, endpoint: _Endpoint, path: str, payload: bytes) -> dict[str, Any]:
        token = self._auth_token(endpoint) if self._username else None
        status, answer = self._post(endpoint, f"/v3/{path}", payload, token)
        if status != 200 and answer.get("code") == _UNAUTHENTICATED and self._username:
            with self._lock:  # the token expired (etcd's --auth-token-ttl): one more
                if self._token == token:
                    self._token = None
            token = self._auth_token(endpoint)
            status, answer = self._post(endpoint, f"/v3/{path}", payload, token)
        if status != 200:
            code = answer.get("code")
            text = answer.get("message") or answer.get("error") or f"HTTP {status}"
            raise EtcdRefused(
                str(text).splitlines()[0][:200], code if isinstance(code, int) else None
            )
        self._current = self.endpoints.index(endpoint)
        return answer

    def _auth_token(self, endpoint: _Endpoint) -> str:
        with self._lock:
            if self._token is not None:
                return self._token
        try:
            with open(self._password_file, encoding="utf-8") as file:
                password = file.readline().rstrip("\r\n")
        except OSError as exc:
            raise FleetError(
                f"cannot read password_file {self._password_file}: {exc.strerror or exc}"
            ) from None
        body = json.dumps({"name": self._username, "password": password}).encode("utf-8")
        status, answer = self._post(endpoint, "/v3/auth/authenticate", body, None)
        if status != 200 or not isinstance(answer.get("token"), str):
            text = answer.get("message") or answer.get("error") or f"HTTP {status}"
            raise EtcdRefused(f"authentication as {self._username}: {text}", None)
        with self._lock:
            self._token = answer["token"]
            return self._token

    def _ssl_context(self) -> ssl.SSLContext:
        if self._context is None:
            ca_file, cert_file, key_file = self._tls
            try:
                context = ssl.create_default_context(cafile=ca_file or None)
                if cert_file:
                    context.load_cert_chain(cert_file, key_file or None)
            except (OSError, ssl.SSLError) as exc:
                raise FleetError(f"cannot load the TLS files: {_one_line(exc)}") from None
            self._context = context
        return self._context

    def _post(
        self, endpoint: _Endpoint, target: str, payload: bytes, token: str | None
    ) -> tuple[int, dict[str, Any]]:
        """One request under a watchdog that shuts the socket at the deadline."""
        connection: http.client.HTTPConnection
        if endpoint.https:
            connection = http.client.HTTPSConnection(
                endpoint.host, endpoint.port, timeout=self.timeout, context=self._ssl_context()
            )
        else:
            connection = http.client.HTTPConnection(
                endpoint.host, endpoint.port, timeout=self.timeout
            )
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            sock = connection.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

        watchdog = threading.Timer(self.timeout, expire)
        watchdog.daemon = True
        watchdog.start()
        headers = {
            "Content-Type": "application/json",
            "User-Agent": f"vkvagent/{__version__}",
            "Connection": "close",
        }
        if token is not None:
            headers["Authorization"] = token
        try:
            connection.request("POST", target, body=payload, headers=headers)
            response = connection.getresponse()
            data = response.read(MAX_BODY + 1)
            status = response.status
        except (OSError, http.client.HTTPException) as exc:
            if expired.is_set():
                raise FleetError(f"no answer within {self.timeout:g} s") from None
            raise FleetError(_transport_problem(exc, self.timeout)) from None
        finally:
            watchdog.cancel()
            connection.close()
        if expired.is_set():
            raise FleetError(f"no answer within {self.timeout:g} s")
        if len(data) > MAX_BODY:
            raise FleetError(f"answer larger than {MAX_BODY} bytes")
        # A streamed answer (lease keepalive) is one JSON object a line: the first is ours.
        first = data.strip().split(b"\n", 1)[0]
        try:
            answer = json.loads(first) if first else {}
        except ValueError:
            raise FleetError(f"HTTP {status}: not a JSON answer (is this etcd?)") from None
        if not isinstance(answer, dict):
            raise FleetError(f"HTTP {status}: unexpected answer")
        return status, answer


@contextlib.contextmanager
def _answer_of(call: str) -> Iterator[None]:
    """An answer without the fields it should have is a FleetError, never a crash."""
    try:
        yield
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise FleetError(f"{call}: unexpected answer ({type(exc).__name__}: {exc})") from None


def _endpoint(url: str) -> _Endpoint:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FleetError(f"not an etcd client URL: {url!r}")
    try:
        port = parts.port or 2379
    except ValueError:
        raise FleetError(f"not an etcd client URL: {url!r}") from None
    return _Endpoint(url.rstrip("/"), parts.scheme == "https", parts.hostname, port)


def _transport_problem(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, socket.timeout):
        return f"no answer within {timeout:g} s"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, socket.gaierror):
        return f"host name not found ({exc.strerror})"
    if isinstance(exc, ssl.SSLError):
        return f"TLS: {_one_line(exc)}"
    if isinstance(exc, http.client.HTTPException):
        return f"not an HTTP answer ({type(exc).__name__})"
    return _one_line(exc)


def _one_line(exc: BaseException) -> str:
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return str(text).splitlines()[0][:200]


# -- the slot protocol ---------------------------------------------------------------------------


class Slot:
    """A slot this host holds: its lease renewed by a thread until ``release()``."""

    def __init__(
        self,
        client: EtcdClient,
        *,
        index: int,
        key: str,
        lease: str,
        ttl: int,
        renewed: float,
        mono: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.index, self.key, self.lease, self.ttl = index, key, lease, ttl
        self.acquired = mono()
        self.since = wall()
        self.lost = threading.Event()
        self.lost_reason = ""
        self._renewed = renewed  # monotonic time the last renewal was asked (or the grant)
        self._mono = mono
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keepalive, name="vkvagent-fleet", daemon=True)
        self._thread.start()

    def _keepalive(self) -> None:
        """Renew every third of the TTL; after a failure, again each second. The lease is
        lost when etcd says it no longer exists, or when no renewal was answered for a TTL
        (etcd may have let it expire: never assume the slot is still ours)."""
        wait = self.ttl / 3
        while not self._stop.wait(wait):
            asked = self._mono()
            try:
                ttl = self.client.keepalive(self.lease)
            except FleetError as exc:
                if self._mono() - self._renewed >= self.ttl:
                    self._lose(f"no renewal answered for {self.ttl} s ({exc})")
                    return
                wait = min(1.0, self.ttl / 3)
                continue
            if ttl <= 0:
                self._lose("etcd let the lease expire")
                return
            self._renewed, wait = asked, self.ttl / 3

    def _lose(self, reason: str) -> None:
        self.lost_reason = reason
        self.lost.set()

    def release(self) -> str | None:
        """Stop renewing and revoke the lease (etcd deletes the key at once). None when
        revoked; else why not (the lease then expires within the TTL)."""
        self._stop.set()
        self._thread.join(timeout=self.client.timeout * len(self.client.endpoints) + 1)
        try:
            self.client.revoke(self.lease)
        except FleetError as exc:
            return str(exc)
        return None

    @property
    def held_seconds(self) -> float:
        return self._mono() - self.acquired


class Fleet:
    """One group's slots in etcd."""

    def __init__(
        self,
        client: EtcdClient,
        *,
        group: str = "default",
        max_concurrent: int = 1,
        lease_ttl: int = 60,
        prefix: str = "/vkvagent/fleet",
        host: str = "",
        mono: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.group, self.max_concurrent, self.lease_ttl = group, max_concurrent, lease_ttl
        self.prefix = f"{prefix.rstrip('/')}/{group}/"
        self.host = host or socket.gethostname()
        self._mono, self._wall = mono, wall
        self._own_lease: str | None = None  # the lease this host's own keys are put with

    @classmethod
    def from_config(cls, cfg: FleetConfig, **clocks: Callable[[], float]) -> Fleet:
        client = EtcdClient(
            cfg.endpoints,
            timeout=cfg.timeout,
            ca_file=cfg.ca_file,
            cert_file=cfg.cert_file,
            key_file=cfg.key_file,
            username=cfg.username,
            password_file=cfg.password_file,
        )
        return cls(
            client,
            group=cfg.group,
            max_concurrent=cfg.max_concurrent,
            lease_ttl=cfg.lease_ttl,
            prefix=cfg.prefix,
            host=cfg.name,
            **clocks,
        )

    @property
    def slots_prefix(self) -> str:
        return f"{self.prefix}slot-"

    def key(self, index: int) -> str:
        return f"{self.slots_prefix}{index}"

    @property
    def hosts_prefix(self) -> str:
        """Where the group's hosts publish their entries: apart from the slots, which are
        read far more often."""
        return f"{self.prefix}hosts/"

    @property
    def own_lease(self) -> str | None:
        """The lease this host's own keys are under (None before the first put)."""
        return self._own_lease

    def put_own(self, key: str, value: str, ttl: int) -> None:
        """Put one of this host's own keys (its entry, its runs) under a lease of its own,
        renewed with each put, so that they leave ``ttl`` seconds after the last. Raises
        FleetError."""
        if self._own_lease is None or not self.client.keepalive(self._own_lease):
            self._own_lease, _granted = self.client.grant(ttl)
        self.client.put(key, value, self._own_lease)

    def entries(self) -> list[tuple[str, str]]:
        """Every host's entry: (host, its value as published), ENTRIES_PAGE a read, so that
        each answer stays within MAX_BODY. Raises FleetError."""
        found: list[dict[str, Any]] = []
        while True:
            start = found[-1]["key"] + "\0" if found else ""
            page = self.client.range_prefix(self.hosts_prefix, ENTRIES_PAGE, start)
            found += page
            if len(page) < ENTRIES_PAGE:
                return [(kv["key"][len(self.hosts_prefix) :], kv["value"]) for kv in found]

    def holders(self) -> list[SlotHolder]:
        """The group's slots held now (one range read). Raises FleetError."""
        found = []
        for kv in self.client.range_prefix(self.slots_prefix):
            name = kv["key"][len(self.prefix) :]
            if not name.startswith("slot-") or not name[5:].isdigit():
                continue
            try:
                value = json.loads(kv["value"])
            except ValueError:
                value = {}
            if not isinstance(value, dict):
                value = {}
            pid, since = value.get("pid"), value.get("since")
            found.append(
                SlotHolder(
                    slot=int(name[5:]),
                    host=str(value.get("host", "?")),
                    pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
                    cause=str(value.get("cause", "")),
                    reason=str(value.get("reason", "")),
                    since=float(since) if isinstance(since, (int, float)) else None,
                    lease=kv["lease"],
                )
            )
        return sorted(found, key=lambda h: h.slot)

    def acquire(self, cause: str, reason: str) -> tuple[Slot | None, list[SlotHolder]]:
        """Take a free slot: the slot (None when all are held) and the holders seen. One
        read when all are held; otherwise a lease grant and one transaction per slot tried.
        Raises FleetError."""
        holders = self.holders()
        taken = {h.slot for h in holders}
        free = [i for i in range(self.max_concurrent) if i not in taken]
        if not free:
            return None, holders
        asked = self._mono()
        lease, ttl = self.client.grant(self.lease_ttl)
        value = json.dumps(
            {
                "host": self.host,
                "pid": os.getpid(),
                "cause": cause,
                "reason": reason[:500],
                "since": round(self._wall(), 3),
            }
        )
        try:
            for index in free:
                if self.client.create(self.key(index), value, lease):
                    slot = Slot(
                        self.client,
                        index=index,
                        key=self.key(index),
                        lease=lease,
                        ttl=ttl,
                        renewed=asked,
                        mono=self._mono,
                        wall=self._wall,
                    )
                    return slot, self._with(holders, index, value, lease)
        except FleetError:
            with contextlib.suppress(FleetError):  # it expires in any case
                self.client.revoke(lease)
            raise
        with contextlib.suppress(FleetError):  # another host was quicker for every free slot
            self.client.revoke(lease)
        return None, self.holders()

    def _with(
        self, holders: list[SlotHolder], index: int, value: str, lease: str
    ) -> list[SlotHolder]:
        mine = json.loads(value)
        added = SlotHolder(index, self.host, mine["pid"], mine["cause"], mine["reason"],
                       mine["since"], lease)  # fmt: skip
        return sorted([*holders, added], key=lambda h: h.slot)


# -- the daemon's gate: slots, on_unreachable, events --------------------------------------------


@dataclass(frozen=True)
class Admission:
    """Whether a restart may go ahead now, the slot it holds (None without a fleet slot) and
    why, in one line."""

    allowed: bool
    slot: Slot | None
    why: str


@dataclass
class Turn:
    """A restart's turn in its group (``Gate.slot``): the admission, and the result the
    slot is given back with, which the action sets ("error" if it raised)."""

    admission: Admission
    result: str = "error"

    @property
    def allowed(self) -> bool:
        return self.admission.allowed


Emit = Callable[..., None]  # Events.emit(name, message, **fields)


class Gate:
    """What the daemon asks before and after a restart. Emits the ``fleet.*`` events: each
    on a change, never once per tick."""

    def __init__(
        self,
        cfg: FleetConfig,
        emit: Emit,
        *,
        fleet: Fleet | None = None,
        publish_every: float = PUBLISH_EVERY,
        mono: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.emit = emit
        self.publish_every = publish_every
        self.fleet = fleet or Fleet.from_config(cfg, mono=mono, wall=wall)
        self._mono, self._wall = mono, wall
        self.state = "idle"  # one of status.FLEET_STATES
        self.error: str | None = None
        self.holders: list[SlotHolder] = []
        self._listed_at: float | None = None  # UTC time of the holders shown
        self._next_list = -float("inf")
        self._quiet_until = -float("inf")  # etcd is not asked before: it did not answer
        self._asked = False  # etcd was asked during this tick already
        self._waited: tuple[str, ...] | None = None
        self._unreachable_told: set[str] = set()  # effects told during this outage
        self._lost_told: set[str] = set()
        self._published: tuple[object, ...] | None = None  # the last entry's facts
        self._publish_at = -float("inf")

    @property
    def group(self) -> str:
        return self.fleet.group

    @contextlib.contextmanager
    def slot(self, *, cause: str, reason: str, emergency: bool) -> Iterator[Turn]:
        """Hold a slot of the group around an action, the one way to act in a fleet. The
        caller acts only if ``turn.allowed`` and sets ``turn.result``; the slot is given back
        however the block ends."""
        turn = Turn(self._enter(cause=cause, reason=reason, emergency=emergency))
        try:
            yield turn
        finally:
            if turn.admission.slot is not None:
                self._leave(turn.admission.slot, turn.result)

    def _enter(self, *, cause: str, reason: str, emergency: bool) -> Admission:
        """Before a restart: take a slot. Not allowed when every slot is held, or when etcd
        does not answer (unless on_unreachable = emergency-only and ``emergency``); etcd that
        did not answer less than RETRY_AFTER ago is not asked again."""
        self._asked = True
        group, n = self.fleet.group, self.fleet.max_concurrent
        quiet = self._mono() < self._quiet_until
        try:
            if quiet:
                raise FleetError(self.error or "etcd unreachable")
            slot, holders = self.fleet.acquire(cause, reason)
        except FleetError as exc:
            if not quiet:
                self._failed(str(exc))
            if emergency and self.cfg.on_unreachable == "emergency-only":
                why = (f"etcd unreachable; restarting without a slot: {cause} is an emergency "
                       "cause (on_unreachable = emergency-only)")  # fmt: skip
                self._tell_unreachable("emergency", why)
                return Admission(True, None, why)
            why = f"etcd unreachable: restart held (on_unreachable = {self.cfg.on_unreachable})"
            self._tell_unreachable("held", why)
            return Admission(False, None, why)
        self._answered(holders)
        if slot is None:
            self.state = "waiting"
            hosts = tuple(f"{h.host} (slot {h.slot})" for h in holders)
            why = f"all {n} slots of group {group} are held: by {', '.join(hosts) or 'others'}"
            if self._waited != hosts:
                self._waited = hosts
                self.emit(
                    "fleet.slot_waited",
                    f"restart waits: {why}",
                    group=group,
                    max_concurrent=n,
                    cause=cause,
                    holders=[h.host for h in holders],
                )
            return Admission(False, None, why)
        self._waited = None
        self.state = "holding"
        self.emit(
            "fleet.slot_acquired",
            f"took slot {slot.index} of {n} in group {group} (lease {slot.ttl} s) to restart",
            group=group,
            slot=slot.index,
            max_concurrent=n,
            lease=slot.lease,
            lease_ttl=slot.ttl,
            cause=cause,
            holders=[h.host for h in holders],
        )
        return Admission(True, slot, f"slot {slot.index} of {n} in group {group}")

    def check(self, slot: Slot) -> bool:
        """Whether ``slot`` is still held; ``fleet.slot_lost`` once when it is not."""
        if not slot.lost.is_set():
            return True
        if slot.lease not in self._lost_told:
            self._lost_told.add(slot.lease)
            self.emit(
                "fleet.slot_lost",
                f"lost slot {slot.index} of group {self.fleet.group} during the restart: "
                f"{slot.lost_reason}; another host may restart now",
                group=self.fleet.group,
                slot=slot.index,
                lease=slot.lease,
                held_s=round(slot.held_seconds, 3),
                error=slot.lost_reason,
            )
        return False

    def _leave(self, slot: Slot, result: str) -> None:
        """After the restart (done, failed, abandoned): give the slot back."""
        held = slot.held_seconds
        self.check(slot)
        error = slot.release()
        self.state = "idle"
        text = f"gave back slot {slot.index} of group {self.fleet.group} after {held:.1f} s"
        if error is not None:
            text += f"; revoking its lease failed ({error}): it expires within {slot.ttl} s"
        self.emit(
            "fleet.slot_released",
            f"{text} ({result})",
            group=self.fleet.group,
            slot=slot.index,
            lease=slot.lease,
            held_s=round(held, 3),
            result=result,
            revoked=error is None,
            error=error,
        )
        self.holders = [h for h in self.holders if h.lease != slot.lease]
        self._next_list = -float("inf")  # list again at the next tick

    def report(self, *, wanting: bool) -> FleetStatus:
        """The fleet's part of status.json. Lists the holders now and then (every
        LIST_EVERY seconds; RETRY_AFTER after etcd did not answer)."""
        if not wanting:
            self._waited = None
            if self.state == "waiting":
                self.state = "idle"
        now = self._mono()
        if not self._asked and now >= self._next_list:
            try:
                holders = self.fleet.holders()
            except FleetError as exc:
                self._failed(str(exc))
                self._tell_unreachable("idle", self._held_then())
            else:
                self._answered(holders)
                if self.state == "unreachable":
                    self.state = "idle"
        self._asked = False
        return FleetStatus(
            group=self.fleet.group,
            host=self.fleet.host,
            max_concurrent=self.fleet.max_concurrent,
            lease_ttl=self.fleet.lease_ttl,
            on_unreachable=self.cfg.on_unreachable,
            state=self.state,
            error=self.error,
            holders=tuple(self.holders),
            listed=self._listed_at,
        )

    def publish(self, report: StatusReport) -> None:
        """Put this host's entry (``fleet_view.HostEntry``) when one is due: at once when
        what it says changes (``HostEntry.facts``), else every ``publish_every`` seconds.
        Never while etcd does not answer: the tick's listing finds out when it does again."""
        if self.state == "unreachable":
            return
        now = self._mono()
        entry = HostEntry.of(report, self.fleet.host, self._wall(), self.publish_every)
        said = entry.facts()
        if said == self._published and now < self._publish_at:
            return
        try:
            self.fleet.put_own(
                self.fleet.hosts_prefix + self.fleet.host,
                json.dumps(entry.to_json(), separators=(",", ":")),
                math.ceil(ENTRY_LEASE * self.publish_every),
            )
        except FleetError as exc:
            self._failed(str(exc))
            self._tell_unreachable("idle", self._held_then())
            return
        self._published, self._publish_at = said, now + self.publish_every

    def _held_then(self) -> str:
        held = self.cfg.on_unreachable
        return f"etcd unreachable: restarts would be held (on_unreachable = {held})"

    def _answered(self, holders: list[SlotHolder]) -> None:
        self.holders = holders
        self._listed_at = self._wall()
        self._next_list = self._mono() + LIST_EVERY
        if self.error is not None:
            self.emit(
                "fleet.reachable",
                f"etcd answers again: group {self.fleet.group} coordinates restarts again",
                group=self.fleet.group,
                error=self.error,
            )
        self.error = None
        self._unreachable_told.clear()
        if self.state == "unreachable":
            self.state = "idle"

    def _failed(self, error: str) -> None:
        self.error = error
        self.state = "unreachable"
        self._quiet_until = self._next_list = self._mono() + RETRY_AFTER

    def _tell_unreachable(self, effect: str, why: str) -> None:
        """Once per outage, and again when a restart is first held by it; each restart
        that goes ahead without a slot (emergency-only) is told."""
        told = self._unreachable_told
        if (effect == "idle" and told) or (effect == "held" and "held" in told):
            return
        told.add(effect)
        self.emit(
            "fleet.unreachable",
            f"{why}: {self.error}",
            group=self.fleet.group,
            on_unreachable=self.cfg.on_unreachable,
            effect=effect,
            error=self.error,
        )

    def close(self) -> None:
        """Nothing is held between ticks; kept for symmetry with the other parts."""
