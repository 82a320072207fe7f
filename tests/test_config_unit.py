"""`config check` reads the vLLM unit over D-Bus and warns of one that vLLM's exit 0 (vLLM 0.32's
when its engine dies) would leave down, or that nothing wants: against a real systemd 252
(tests/sandbox.py), whose answers (Restart=, UnitFileState, WantedBy, LoadState) are systemd's
own. Without systemd the check is of the files: a note, never a failure."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.sandbox import MASKED, Sandbox, require
from tests.test_daemon import write_config
from vkvagent.tools.cli import main
from vkvagent.tools.exitcodes import ExitCode

NO_BUS = "unix:path=/run/no-such-bus/system_bus_socket"


def unit(service: str, install: bool = True) -> str:
    """A unit that only sleeps: the test reads its settings, not what it runs."""
    return (
        "[Unit]\nDescription=a vLLM unit as an operator wrote it\n"
        f"[Service]\nExecStart=/bin/sleep infinity\n{service}\n"
        + ("[Install]\nWantedBy=multi-user.target\n" if install else "")
    )


UNITS = {
    "vllm.service": unit("Restart=on-failure"),  # enabled: the usual unit, and the bug
    "kept.service": unit("Restart=always"),  # enabled
    "idle.service": unit("Restart=always"),  # not enabled, nothing wants it
    "bare.service": unit("Restart=on-abnormal"),  # not enabled
    "static.service": unit("Restart=always", install=False),  # cannot be enabled
    "wanted.service": unit("Restart=no", install=False),  # wanted by another unit
    "broken.service": "[Service]\nType=simple\n",  # no ExecStart=: systemd refuses to load it
}
# Wants= another unit: wanted.service is wanted though never enabled.
UNITS["needs.service"] = unit("").replace("[Service]", "Wants=wanted.service\n[Service]")
# vLLM serving TLS behind a key in its environment (what runs does not matter here).
UNITS["tls.service"] = unit("Restart=always\nEnvironment=VLLM_API_KEY=sk-tls").replace(
    "/bin/sleep infinity", "/bin/sleep --ssl-certfile /etc/vllm/tls.pem infinity"
)


@pytest.fixture(scope="module")
def box() -> Iterator[Sandbox]:
    require()
    enabled = ["vllm.service", "kept.service", "needs.service", "tls.service"]
    with Sandbox(units=UNITS, enable=enabled, masked=(*MASKED, "gone.service")) as booted:
        yield booted


def checked(
    tmp_path: Path, name: str, mode: str, bus: str, capsys: pytest.CaptureFixture[str]
) -> tuple[list[str], str]:
    """`config check` of a config watching ``name`` in ``mode``, with the system bus at
    ``bus``: the warnings on stderr and the notes on stdout that name the unit."""
    path = write_config(tmp_path, "http://127.0.0.1:8000", vllm={"unit": name},
                        policy={"mode": mode})  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DBUS_SYSTEM_BUS_ADDRESS", bus)
        out = io.StringIO()
        assert main(["config", "check", str(path)], out) == 0  # a warning fails nothing
    said = capsys.readouterr()
    notes = [line for line in out.getvalue().splitlines() if line.startswith(f"# {name}")]
    warnings = [line for line in said.err.splitlines() if name in line]
    assert len(notes) <= 1
    return warnings, notes[0] if notes else ""


def test_without_systemd_the_unit_is_a_note_and_the_check_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    warnings, note = checked(tmp_path, "vllm.service", "enforce", NO_BUS, capsys)
    assert warnings == []
    assert note.startswith("# vllm.service not checked: connect: bus unavailable: ")


ENFORCE = "vkvagent starts it again within a sample interval (enforce mode, max_per_day allowing)"
EXIT_0 = "vLLM exits 0 when its engine dies (vLLM 0.32 does)"


@pytest.mark.systemd
@pytest.mark.parametrize(
    ("name", "mode", "warning"),
    [
        ("vllm.service", "enforce",
         f"vllm.service has Restart=on-failure: {EXIT_0}, and systemd then leaves it down; "
         f"{ENFORCE}, but set Restart=always to have systemd do it at once"),
        ("vllm.service", "observe",
         f"vllm.service has Restart=on-failure: {EXIT_0}, and systemd then leaves it down, and "
         "vkvagent in observe mode does not start it: set Restart=always"),
        ("kept.service", "enforce", None),
        ("wanted.service", "enforce",  # Restart=no; wanted by needs.service, never enabled
         f"wanted.service has Restart=no: {EXIT_0}, and systemd then leaves it down; "
         f"{ENFORCE}, but set Restart=always to have systemd do it at once"),
        ("idle.service", "enforce",
         "idle.service is not enabled and no unit wants it: it does not start at boot, and "
         "vkvagent does not start it when it is down; systemctl enable idle.service"),
        ("bare.service", "enforce",
         f"bare.service is not enabled and no unit wants it, and it has Restart=on-abnormal: "
         f"{EXIT_0}, and then neither systemd nor vkvagent starts it again; set Restart=always, "
         "and systemctl enable bare.service"),
        ("static.service", "enforce",
         "static.service has no [Install] section and no unit wants it: it does not start at "
         "boot, and vkvagent does not start it when it is down; add WantedBy=multi-user.target "
         "under [Install], then systemctl enable static.service"),
        ("gone.service", "enforce",
         "gone.service is masked: neither systemd nor vkvagent can start it (systemctl unmask "
         "gone.service, then systemctl enable gone.service)"),
        ("broken.service", "enforce",
         "systemd cannot load broken.service (LoadState=bad-setting): neither systemd nor "
         "vkvagent can start it (systemctl status broken.service says why)"),
    ],
)  # fmt: skip
def test_config_check_warns_of_a_unit_vllms_exit_0_or_nobody_wanting_it_leaves_down(
    box: Sandbox,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    mode: str,
    warning: str | None,
) -> None:
    warnings, note = checked(tmp_path, name, mode, box.bus_address, capsys)
    assert note == ""
    assert warnings == ([f"vkvagent: warning: {warning}"] if warning else [])


@pytest.mark.systemd
def test_a_unit_systemd_does_not_have_is_a_note_not_a_warning(
    box: Sandbox, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """vkvagent may be configured before vLLM's unit is installed."""
    warnings, note = checked(tmp_path, "later.service", "enforce", box.bus_address, capsys)
    assert warnings == []
    assert note == (
        "# later.service not checked: read later.service: no such unit: "
        "Unit later.service not found."
    )


@pytest.mark.systemd
def test_a_unit_serving_tls_to_an_http_url_is_a_warning_and_the_keys_source_a_note(
    box: Sandbox, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    warnings, _note = checked(tmp_path, "tls.service", "enforce", box.bus_address, capsys)
    assert warnings == [
        "vkvagent: warning: tls.service serves https (--ssl-certfile) but [vllm] url is "
        'http://127.0.0.1:8000: set url = "https://..." and, for a certificate of your own CA, '
        "ca_file"
    ]
    path = write_config(tmp_path, "https://127.0.0.1:8000", vllm={"unit": "tls.service"})
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DBUS_SYSTEM_BUS_ADDRESS", box.bus_address)
        out = io.StringIO()
        assert main(["config", "check", str(path)], out) == 0
    assert "tls.service" not in capsys.readouterr().err
    assert "# the probe sends vLLM's API key from the unit's Environment=VLLM_API_KEY\n" in (
        out.getvalue()
    )
    assert "sk-tls" not in out.getvalue()


def test_a_key_file_others_may_read_fails_the_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = tmp_path / "vllm.key"
    key.write_text("sk-loose\n")
    key.chmod(0o644)
    path = write_config(tmp_path, "http://127.0.0.1:8000", vllm={"api_key_file": str(key)})
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DBUS_SYSTEM_BUS_ADDRESS", NO_BUS)
        assert main(["config", "check", str(path)], io.StringIO()) == ExitCode.FAILURE
    said = capsys.readouterr().err
    assert f"api_key_file {key}: group or others may read it (mode 0644); chmod 600 it" in said
    assert "sk-loose" not in said
