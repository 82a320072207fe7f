"""systemd's manager over D-Bus (jeepney, blocking I/O): read a service's state, reload unit
files, restart a service and wait for the job's outcome, clear a failed state.

The bus address is an argument (default: the system bus, which honours
``DBUS_SYSTEM_BUS_ADDRESS``), so tests talk to a real systemd booted in a container. Every
failure, from a missing bus socket to a D-Bus error reply, is raised as ``SystemdError`` whose
message is one line naming the operation and the unit, e.g.
``restart vllm.service: access denied: Access denied``. Nothing here decides anything.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from jeepney import DBusAddress, MatchRule, Message, MessageType, new_method_call
from jeepney.auth import AuthenticationError
from jeepney.io.blocking import DBusConnection, open_dbus_connection
from jeepney.wrappers import DBusErrorResponse

from vkvagent import apikey
from vkvagent.apikey import ApiKey
from vkvagent.errors import VkvagentError

SYSTEMD = "org.freedesktop.systemd1"
MANAGER_PATH = "/org/freedesktop/systemd1"
MANAGER = f"{SYSTEMD}.Manager"
UNIT = f"{SYSTEMD}.Unit"
SERVICE = f"{SYSTEMD}.Service"
PROPERTIES = "org.freedesktop.DBus.Properties"
UINT64_MAX = 2**64 - 1

# SystemdError.reason values.
UNAVAILABLE = "unavailable"
ACCESS_DENIED = "access-denied"
NO_SUCH_UNIT = "no-such-unit"
TIMEOUT = "timeout"
# systemctl daemon-reload's own bound: twice DefaultTimeoutSec, so that the generators a reload
# runs have their 90 s. A reload took over 25 s (the bound of other calls) on a loaded host.
RELOAD_TIMEOUT = 180.0
ERROR = "error"

_REASON_TEXT = {
    UNAVAILABLE: "bus unavailable",
    ACCESS_DENIED: "access denied",
    NO_SUCH_UNIT: "no such unit",
    TIMEOUT: "timed out",
}
_DBUS_REASONS = {
    "org.freedesktop.DBus.Error.AccessDenied": ACCESS_DENIED,
    # What systemd answers an unprivileged caller when polkit runs but no agent can ask.
    "org.freedesktop.DBus.Error.InteractiveAuthorizationRequired": ACCESS_DENIED,
    f"{SYSTEMD}.NoSuchUnit": NO_SUCH_UNIT,
    "org.freedesktop.DBus.Error.NoReply": TIMEOUT,
    "org.freedesktop.DBus.Error.Timeout": TIMEOUT,
    "org.freedesktop.DBus.Error.ServiceUnknown": UNAVAILABLE,
    "org.freedesktop.DBus.Error.NameHasNoOwner": UNAVAILABLE,
}


class SystemdError(VkvagentError):
    """A systemd operation that could not be done; ``str()`` is one line.

    ``reason`` is one of ``unavailable``, ``access-denied``, ``no-such-unit``, ``timeout`` or
    ``error``; ``dbus_error`` is the D-Bus error name when the bus answered with one."""

    def __init__(
        self,
        operation: str,
        unit: str | None,
        reason: str,
        detail: str,
        dbus_error: str | None = None,
    ) -> None:
        self.operation = operation
        self.unit = unit
        self.reason = reason
        self.detail = " ".join(detail.split())
        self.dbus_error = dbus_error
        what = f"{operation} {unit}" if unit else operation
        kind = _REASON_TEXT.get(reason) or dbus_error or "error"
        super().__init__(f"{what}: {kind}: {self.detail}" if self.detail else f"{what}: {kind}")


class ExecCommand(NamedTuple):
    """One ``ExecStart=`` line as systemd parsed it."""

    path: str
    argv: tuple[str, ...]
    ignore_failure: bool  # the line was prefixed with "-"


@dataclass(frozen=True)
class UnitState:
    """A unit's properties as systemd reported them at one moment."""

    name: str
    load_state: str  # loaded, not-found, masked, bad-setting, error
    active_state: str  # active, activating, deactivating, inactive, failed, reloading
    sub_state: str  # for a service: running, exited, dead, failed, auto-restart, ...
    result: str  # success, exit-code, signal, start-limit-hit, ... ("" for a non-service)
    main_pid: int  # 0 when no main process runs
    invocation_id: str  # 32 hex digits, new for every start; "" when never started
    exec_main_start_timestamp: int  # CLOCK_REALTIME, µs since the epoch; 0 when never started
    n_restarts: int  # automatic restarts (Restart=) only; see restarted.restarted for the reset
    memory_current: int | None  # bytes; None when not accounted
    exec_start: tuple[ExecCommand, ...]
    fragment_path: str  # the unit file; "" when there is none
    drop_in_paths: tuple[str, ...]
    start_limit_burst: int
    start_limit_interval_usec: int
    # The unit's cgroup, relative to the cgroup root (e.g. "/system.slice/vllm.service");
    # "" when it has none (not running, or not a service).
    control_group: str = ""
    # When the unit last became active (CLOCK_REALTIME, µs since the epoch); 0: never.
    active_enter_timestamp: int = 0
    # MemoryMax: the cgroup's hard limit, where the kernel OOM-kills; None when unlimited.
    memory_max: int | None = None
    restart_policy: str = ""  # Restart=: no, on-success, on-failure, on-abnormal, always, ...
    unit_file_state: str = ""  # enabled, disabled, static, masked, ...; "" when unknown
    # The units that want or require it (a target it is enabled in, or a Requires=/Wants=).
    wanted_by: tuple[str, ...] = ()
    # How the main process last ended: code (1 exited, 2 killed, 3 dumped core; 0 never
    # ended) and status (the exit status, or the signal's number).
    exec_main_code: int = 0
    exec_main_status: int = 0
    # When the unit last left the active state (CLOCK_REALTIME, µs since the epoch); 0: never.
    inactive_enter_timestamp: int = 0
    # The file a generator made the unit from (a Quadlet `.container`); "" for a unit file.
    source_path: str = ""
    # ExecStop= commands' argv (a container engine's `stop -t N` bounds vLLM's drain).
    exec_stop: tuple[tuple[str, ...], ...] = ()
    # KillMode=: control-group (systemd's default) sends the stop's SIGTERM to every process.
    kill_mode: str = ""
    # vLLM's API key as the unit gives it (apikey.from_unit); never shown.
    api_key: ApiKey | None = field(default=None, repr=False, compare=False)

    @property
    def wanted(self) -> bool:
        """Enabled, or wanted or required by another unit: meant to run, unless masked."""
        return self.load_state != "masked" and (
            bool(self.wanted_by) or self.unit_file_state in ("enabled", "enabled-runtime")
        )

    @property
    def exit_text(self) -> str:
        """How the main process last ended, as systemd logs it ("status=0", "signal 9")."""
        if self.exec_main_code == 1:
            return f"exited with status {self.exec_main_status}"
        if self.exec_main_code in (2, 3):
            what = "dumped core on" if self.exec_main_code == 3 else "killed by"
            return f"{what} signal {self.exec_main_status}"
        return ""


class Systemd:
    """A connection to systemd's manager. ``with Systemd(address) as systemd: ...``

    ``address`` is a D-Bus address (``unix:path=/run/dbus/system_bus_socket``); None means the
    system bus. ``timeout`` bounds each method call, in seconds. The connection is opened on
    first use (or by ``connect()``) and opened again after the bus went away."""

    def __init__(self, address: str | None = None, *, timeout: float = 25.0) -> None:
        self.address = address
        self.timeout = timeout
        self._connection: DBusConnection | None = None
        self._subscribed = False

    def __enter__(self) -> Systemd:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self) -> None:
        self._connect("connect", None)

    def close(self) -> None:
        if self._connection is not None:
            connection, self._connection = self._connection, None
            self._subscribed = False
            connection.close()

    # -- operations --------------------------------------------------------------------------

    def unit(self, name: str) -> UnitState:
        """The unit's state; loads its file if systemd has not (LoadUnit, unlike GetUnit, also
        answers for an inactive unit). A unit without a file raises ``no-such-unit``."""
        operation = "read"
        path = self._call(operation, name, _manager("LoadUnit", "s", (name,)))[0]
        unit = self._properties(operation, name, path, UNIT)
        if unit["LoadState"] == "not-found":
            error = unit.get("LoadError", ("", ""))
            raise SystemdError(operation, name, NO_SUCH_UNIT, error[1], error[0] or None)
        service = self._properties(operation, name, path, SERVICE) if _is_service(name) else {}
        memory = service.get("MemoryCurrent", UINT64_MAX)
        limit = service.get("MemoryMax", UINT64_MAX)
        commands = service.get("ExecStart", [])
        return UnitState(
            name=name,
            load_state=unit["LoadState"],
            active_state=unit["ActiveState"],
            sub_state=unit["SubState"],
            result=service.get("Result", ""),
            main_pid=service.get("MainPID", 0),
            invocation_id=bytes(unit.get("InvocationID", b"")).hex(),
            exec_main_start_timestamp=service.get("ExecMainStartTimestamp", 0),
            n_restarts=service.get("NRestarts", 0),
            memory_current=None if memory == UINT64_MAX else memory,
            exec_start=tuple(  # vLLM's API key blanked out: nothing that shows argv shows it
                ExecCommand(entry[0], apikey.mask_argv(entry[1]), bool(entry[2]))
                for entry in commands
            ),
            fragment_path=unit["FragmentPath"],
            drop_in_paths=tuple(unit["DropInPaths"]),
            start_limit_burst=unit["StartLimitBurst"],
            start_limit_interval_usec=unit["StartLimitIntervalUSec"],
            control_group=service.get("ControlGroup", ""),
            active_enter_timestamp=unit.get("ActiveEnterTimestamp", 0),
            memory_max=None if limit == UINT64_MAX else limit,
            restart_policy=service.get("Restart", ""),
            unit_file_state=unit.get("UnitFileState", ""),
            wanted_by=tuple(unit.get("WantedBy", ())) + tuple(unit.get("RequiredBy", ())),
            exec_main_code=service.get("ExecMainCode", 0),
            exec_main_status=service.get("ExecMainStatus", 0),
            inactive_enter_timestamp=unit.get("InactiveEnterTimestamp", 0),
            source_path=unit.get("SourcePath", ""),
            exec_stop=tuple(apikey.mask_argv(entry[1]) for entry in service.get("ExecStop", [])),
            kill_mode=service.get("KillMode", ""),
            api_key=apikey.from_unit(
                commands[-1][1] if commands else (),
                service.get("Environment", ()),
                [path for path, _may_be_missing in service.get("EnvironmentFiles", ())],
            )
            if service
            else None,
        )

    def reload(self, timeout: float = RELOAD_TIMEOUT) -> None:
        """Reload every unit file (``systemctl daemon-reload``); returns once systemd has."""
        self._call("reload", None, _manager("Reload"), timeout)

    def start(
        self,
        name: str,
        timeout: float = 90.0,
        *,
        tick: Callable[[], None] | None = None,
        every: float = 0.5,
    ) -> str:
        """Start the unit (mode "replace"), as ``restart`` does for a unit that is down."""
        return self._job("start", "StartUnit", name, timeout, tick, every)

    def restart(
        self,
        name: str,
        timeout: float = 90.0,
        *,
        tick: Callable[[], None] | None = None,
        every: float = 0.5,
    ) -> str:
        """Restart the unit (mode "replace") and wait for the job to end. Returns the job's
        result: done, failed, timeout, canceled, dependency or skipped.

        "done" means the start command ran (for Type=simple, that the process was forked), not
        that the service is ready. Raises ``SystemdError`` (reason ``timeout``) when the job
        has not ended within ``timeout`` seconds; the job itself goes on. ``tick`` is called
        about every ``every`` seconds while the job runs (a stop that drains takes long)."""
        return self._job("restart", "RestartUnit", name, timeout, tick, every)

    def _job(
        self,
        operation: str,
        method: str,
        name: str,
        timeout: float,
        tick: Callable[[], None] | None,
        every: float,
    ) -> str:
        deadline = time.monotonic() + timeout
        connection = self._connect(operation, name)
        if not self._subscribed:
            self._call(operation, name, _manager("Subscribe"))
            self._subscribed = True
        # Signals carry systemd's unique name as sender, so the rule names no sender.
        rule = MatchRule(type="signal", interface=MANAGER, member="JobRemoved", path=MANAGER_PATH)
        self._call(operation, name, _bus("AddMatch", rule.serialise()))
        try:
            with connection.filter(rule, queue=deque()) as removed:
                job = self._call(operation, name, _manager(method, "ss", (name, "replace")))
                return self._wait_job(
                    operation, name, job[0], removed, deadline, timeout, tick, every
                )
        finally:
            if self._connection is connection:
                with contextlib.suppress(SystemdError):  # a match left behind does no harm
                    self._call(operation, name, _bus("RemoveMatch", rule.serialise()))

    def kill(self, name: str, signal: int) -> None:
        """Send ``signal`` to every process of the unit (``systemctl kill --kill-whom=all``)."""
        self._call("kill", name, _manager("KillUnit", "ssi", (name, "all", signal)))

    def reset_failed(self, name: str) -> None:
        """Clear the unit's failed state and its start-limit counter."""
        self._call("reset-failed", name, _manager("ResetFailedUnit", "s", (name,)))

    # -- plumbing ----------------------------------------------------------------------------

    def _connect(self, operation: str, unit: str | None) -> DBusConnection:
        if self._connection is None:
            try:
                self._connection = open_dbus_connection(
                    bus=self.address or "SYSTEM", auth_timeout=self.timeout
                )
            except (OSError, AuthenticationError, RuntimeError, ValueError, KeyError) as exc:
                where = self.address or "the system bus"
                raise SystemdError(operation, unit, UNAVAILABLE, f"{where}: {exc}") from None
        return self._connection

    def _call(
        self,
        operation: str,
        unit: str | None,
        message: Message,
        timeout: float | None = None,
    ) -> tuple[Any, ...]:
        connection = self._connect(operation, unit)
        try:
            reply = connection.send_and_get_reply(message, timeout=timeout or self.timeout)
        except TimeoutError:
            raise SystemdError(
                operation, unit, TIMEOUT, f"no reply within {timeout or self.timeout:g} s"
            ) from None
        except OSError as exc:
            self.close()
            raise SystemdError(operation, unit, UNAVAILABLE, f"connection lost: {exc}") from None
        if reply.header.message_type == MessageType.error:
            error = DBusErrorResponse(reply)
            detail = str(error.data[0]) if error.data else ""
            name = str(error.name)
            raise SystemdError(operation, unit, _DBUS_REASONS.get(name, ERROR), detail, name)
        return tuple(reply.body)

    def _properties(self, operation: str, unit: str, path: str, interface: str) -> dict[str, Any]:
        address = DBusAddress(path, bus_name=SYSTEMD, interface=PROPERTIES)
        found = self._call(operation, unit, new_method_call(address, "GetAll", "s", (interface,)))
        return {key: value for key, (_signature, value) in found[0].items()}

    def _wait_job(
        self,
        operation: str,
        unit: str,
        job: str,
        removed: deque[Message],
        deadline: float,
        timeout: float,
        tick: Callable[[], None] | None,
        every: float,
    ) -> str:
        connection = self._connect(operation, unit)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 and not removed:
                detail = f"job {job} had not ended after {timeout:g} s"
                raise SystemdError(operation, unit, TIMEOUT, detail)
            wait = max(left, 0.0) if tick is None else min(max(left, 0.0), every)
            try:
                message = connection.recv_until_filtered(removed, timeout=wait)
            except TimeoutError:
                if tick is not None:
                    tick()
                continue
            except OSError as exc:
                self.close()
                raise SystemdError(
                    operation, unit, UNAVAILABLE, f"connection lost: {exc}"
                ) from None
            _id, path, _unit, result = message.body
            if path == job:
                return str(result)


def _is_service(name: str) -> bool:
    return name.endswith(".service")


def _manager(method: str, signature: str | None = None, body: tuple[Any, ...] = ()) -> Message:
    address = DBusAddress(MANAGER_PATH, bus_name=SYSTEMD, interface=MANAGER)
    return new_method_call(address, method, signature, body)


def _bus(method: str, argument: str) -> Message:
    address = DBusAddress(
        "/org/freedesktop/DBus", bus_name="org.freedesktop.DBus", interface="org.freedesktop.DBus"
    )
    return new_method_call(address, method, "s", (argument,))
