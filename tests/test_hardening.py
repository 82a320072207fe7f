"""What the hardened unit refuses: read from the shipped systemd/vkvagent.service itself, so
that `config check` and the unit cannot drift apart."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from vkvagent.knowledge import config, hardening
from vkvagent.knowledge.hardening import HIDDEN, PRIVATE, READ, WRITE, Sandbox
from vkvagent.tools.cli import main

PROJECT = Path(__file__).resolve().parent.parent
SHIPPED = PROJECT / "systemd/vkvagent.service"
# The operator: another unit, the example's textfile path, a state elsewhere, and a
# hook that is given a file it writes.
TRAPPED = """\
[agent]
state_dir = "/srv/vkvagent"
[vllm]
unit = "my-vllm"
[metrics]
textfile = "/var/lib/node_exporter/textfile_collector/vkvagent.prom"
[restart]
pre_stop = ["/bin/sh", "/usr/local/bin/lb-out", "--state=/var/lib/lb/hosts.json"]
"""


def load(tmp_path: Path, text: str) -> config.Config:
    path = tmp_path / "config.toml"
    path.write_text(text, encoding="utf-8")
    return config.load(path, as_root=False)


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A file system with the shipped unit installed where the deb puts it."""
    top = tmp_path / "root"
    (top / "lib/systemd/system").mkdir(parents=True)
    shutil.copy(SHIPPED, top / "lib/systemd/system/vkvagent.service")
    monkeypatch.setattr(hardening, "ROOT", top)
    return top


def test_the_shipped_unit_allows_the_default_configuration_and_nothing_else() -> None:
    sandbox = Sandbox.parse([SHIPPED])
    assert hardening.refusals(config.Config(), sandbox) == []
    assert sandbox.access("/var/lib/vkvagent/history.sqlite") == WRITE
    assert sandbox.access("/etc/systemd/system/vllm.service.d") == WRITE
    assert sandbox.access("/etc/containers/systemd/vllm.container.d") == WRITE
    assert sandbox.access("/etc/containers/systemd/other.container") == READ
    assert sandbox.access("/etc/systemd/system/other.service.d") == READ
    assert sandbox.access("/var/lib/node_exporter") == READ
    assert sandbox.access("/proc/1/environ") == READ
    assert sandbox.access("/home/ops/x") == HIDDEN
    assert sandbox.access("/tmp/x") == PRIVATE


def test_each_setting_the_unit_refuses_is_named_with_the_drop_in_that_allows_it(
    tmp_path: Path,
) -> None:
    found = hardening.refusals(load(tmp_path, TRAPPED), Sandbox.parse([SHIPPED]))
    assert [(r.key, r.message) for r in found] == [
        ("vllm.unit", "my-vllm.service: vkvagent.service cannot write its drop-in directory "
         "/etc/systemd/system/my-vllm.service.d (ProtectSystem=strict)"),
        ("agent.state_dir", "/srv/vkvagent: vkvagent.service cannot write it "
         "(ProtectSystem=strict)"),
        ("metrics.textfile", "/var/lib/node_exporter/textfile_collector/vkvagent.prom: "
         "vkvagent.service cannot write its directory (ProtectSystem=strict)"),
        ("restart.pre_stop", "/var/lib/lb/hosts.json: if the hook writes there, "
         "vkvagent.service refuses it (ProtectSystem=strict)"),
    ]  # fmt: skip
    assert hardening.dropin(found) == (
        "[Service]\n"
        "ExecStartPre=+/bin/mkdir -p /etc/systemd/system/my-vllm.service.d\n"
        "ReadWritePaths=-/etc/systemd/system/my-vllm.service.d\n"
        "ReadWritePaths=-/srv/vkvagent\n"
        "ReadWritePaths=-/var/lib/node_exporter/textfile_collector\n"
        "# restart.pre_stop: only if it writes there\n"
        "ReadWritePaths=-/var/lib/lb\n"
    )


def test_a_unit_quadlet_generates_needs_its_container_files_drop_in_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM run by Quadlet from my-vllm.container: vkvagent writes the drop-in of that file,
    which the shipped unit allows for vllm.container alone."""
    quadlet = tmp_path / "containers"
    quadlet.mkdir()
    (quadlet / "my-vllm.container").write_text("[Container]\nImage=vllm/vllm-openai\n")
    (quadlet / "vllm.container").write_text("[Container]\nImage=vllm/vllm-openai\n")
    monkeypatch.setattr(hardening, "QUADLET_DIRS", (str(quadlet),))
    shipped = Sandbox.parse([SHIPPED])
    assert hardening.refusals(load(tmp_path, '[vllm]\nunit = "vllm"\n'), shipped) == []
    found = hardening.refusals(load(tmp_path, '[vllm]\nunit = "my-vllm"\n'), shipped)
    directory = "/etc/containers/systemd/my-vllm.container.d"
    assert [r.message for r in found][1:] == [
        f"my-vllm.service: vkvagent.service cannot write the drop-in directory {directory} "
        "of its Quadlet file (ProtectSystem=strict)"
    ]
    text = hardening.dropin(found)
    assert text is not None
    assert f"ExecStartPre=+/bin/mkdir -p {directory}\nReadWritePaths=-{directory}\n" in text


def test_the_printed_drop_in_once_installed_silences_every_warning(
    tmp_path: Path, root: Path
) -> None:
    cfg = load(tmp_path, TRAPPED)
    before = Sandbox.installed()
    assert before is not None and len(hardening.refusals(cfg, before)) == 4
    text = hardening.dropin(hardening.refusals(cfg, before))
    assert text is not None
    dropin = root / hardening.DROPIN.lstrip("/")
    dropin.parent.mkdir(parents=True)
    dropin.write_text(text, encoding="utf-8")
    after = Sandbox.installed()
    assert after is not None and after.files[-1] == dropin
    assert hardening.refusals(cfg, after) == []


def test_what_no_drop_in_should_open_is_told_to_move(tmp_path: Path) -> None:
    cfg = load(
        tmp_path,
        '[metrics]\ntextfile = "/tmp/vkvagent.prom"\n[gpu]\nrecording = "/home/ops/gpu.json"\n',
    )
    found = hardening.refusals(cfg, Sandbox.parse([SHIPPED]))
    assert [(r.key, r.message, r.grant) for r in found] == [
        ("metrics.textfile", "/tmp: vkvagent.service cannot see it (PrivateTmp=yes): move it "
         "elsewhere", None),
        ("gpu.recording", "/home/ops/gpu.json: vkvagent.service cannot see it (ProtectHome=yes): "
         "move it elsewhere", None),
    ]  # fmt: skip
    assert hardening.dropin(found) is None


def test_unit_files_are_read_as_systemd_reads_them(tmp_path: Path) -> None:
    unit = tmp_path / "a.service"
    unit.write_text(
        "[Unit]\nReadWritePaths=/not/service\n[Service]\n# ReadWritePaths=/commented\n"
        "ProtectSystem=full\nReadWritePaths=-/etc/a \\\n  /etc/b\nStateDirectory=a b\n",
        encoding="utf-8",
    )
    reset = tmp_path / "reset.conf"
    reset.write_text("[Service]\nReadWritePaths=\nReadWritePaths=/etc/c\n", encoding="utf-8")
    assert Sandbox.parse([unit]).read_write == ("/etc/a", "/etc/b", "/var/lib/a", "/var/lib/b")
    sandbox = Sandbox.parse([unit, reset])
    assert sandbox.read_write == ("/etc/c", "/var/lib/a", "/var/lib/b")
    assert (sandbox.access("/etc/a"), sandbox.access("/etc/c/x"), sandbox.access("/srv")) == (
        READ,
        WRITE,
        WRITE,
    )


def test_the_installed_unit_is_found_as_systemd_finds_it(root: Path) -> None:
    etc = root / "etc/systemd/system"
    (etc / "vkvagent.service.d").mkdir(parents=True)
    (root / "lib/systemd/system/vkvagent.service.d").mkdir()
    (root / "lib/systemd/system/vkvagent.service.d/10-a.conf").write_text("[Service]\n")
    (root / "lib/systemd/system/vkvagent.service.d/20-b.conf").write_text("[Service]\n")
    (etc / "vkvagent.service.d/20-b.conf").write_text("[Service]\nReadWritePaths=/srv\n")
    (etc / "vkvagent.service.d/30-c.txt").write_text("[Service]\nReadWritePaths=/opt\n")
    sandbox = Sandbox.installed()
    assert sandbox is not None
    assert sandbox.files == (
        root / "lib/systemd/system/vkvagent.service",
        root / "lib/systemd/system/vkvagent.service.d/10-a.conf",
        etc / "vkvagent.service.d/20-b.conf",
    )
    assert sandbox.access("/srv/x") == WRITE and sandbox.access("/opt/x") == READ
    assert Sandbox.installed(root / "nowhere") is None


def test_config_check_warns_and_prints_the_drop_in_instead_of_configuration_ok(
    tmp_path: Path, root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.toml").write_text(TRAPPED, encoding="utf-8")
    assert main(["config", "check", str(tmp_path / "config.toml")]) == 0
    said = capsys.readouterr()
    assert said.out.startswith("# configuration valid, with 4 warning(s) on stderr; read: ")
    assert "configuration OK" not in said.out
    err = said.err.splitlines()
    assert err[0] == (
        "vkvagent: warning: vllm.unit: my-vllm.service: vkvagent.service cannot write its "
        "drop-in directory /etc/systemd/system/my-vllm.service.d (ProtectSystem=strict)"
    )
    assert err[4] == (
        "vkvagent: the hardened vkvagent.service allows them with this drop-in, "
        "/etc/systemd/system/vkvagent.service.d/50-paths.conf (then: systemctl daemon-reload; "
        "systemctl restart vkvagent):"
    )
    text = hardening.dropin(hardening.refusals(load(tmp_path, TRAPPED), Sandbox.parse([SHIPPED])))
    assert text is not None and err[5:] == text.splitlines()
    (tmp_path / "config.toml").write_text("", encoding="utf-8")
    assert main(["config", "check", str(tmp_path / "config.toml")]) == 0
    said = capsys.readouterr()
    assert said.out.startswith("# configuration OK; read: ") and said.err == ""
