"""vLLM's API key and TLS: where the key is found, that it is sent, that it never shows, and
https with a CA of the operator's; each against real servers on loopback."""

from __future__ import annotations

import io
import json
import os
import ssl
from pathlib import Path

import pytest

from tests.certificates import make_certificates
from tests.httpserver import Handler, HttpServer
from vkvagent import apikey
from vkvagent.adapters.probe import Prober
from vkvagent.adapters.vllm import ScrapeError, VllmClient
from vkvagent.apikey import ApiKey, KeyFileError
from vkvagent.knowledge.events import Events
from vkvagent.knowledge.vllm_command import VllmCommandError, apply_flags

KEY = "sk-test-5b0e1c7a9d"
MASKED = apikey.MASK


@pytest.mark.parametrize(
    ("argv", "masked"),
    [
        (["vllm", "serve", "m", "--api-key", KEY], ["vllm", "serve", "m", "--api-key", MASKED]),
        (["vllm", "serve", f"--api-key={KEY}", "--port", "8000"],
         ["vllm", "serve", f"--api-key={MASKED}", "--port", "8000"]),
        (["vllm", "serve", "--api_key", "a", "b", "--port", "1"],
         ["vllm", "serve", "--api_key", MASKED, MASKED, "--port", "1"]),
        (["vllm", "serve", "m", "--port", "8000"], ["vllm", "serve", "m", "--port", "8000"]),
        (["vllm", "serve", "--api-key"], ["vllm", "serve", "--api-key"]),
        # A reference to the unit's environment is no secret: kept, so a drop-in keeps it.
        (["vllm", "serve", "--api-key", "${KEY}", "$K2", "x"],
         ["vllm", "serve", "--api-key", "${KEY}", "$K2", MASKED]),
        (["vllm", "serve", "--api-key=${KEY}"], ["vllm", "serve", "--api-key=${KEY}"]),
        # A container engine's environment for vLLM, in each spelling.
        (["podman", "run", "-e", f"VLLM_API_KEY={KEY}", f"-eVLLM_API_KEY={KEY}",
          f"--env=VLLM_API_KEY={KEY}", "-e", "VLLM_API_KEY=${K}", "img"],
         ["podman", "run", "-e", f"VLLM_API_KEY={MASKED}", f"-eVLLM_API_KEY={MASKED}",
          f"--env=VLLM_API_KEY={MASKED}", "-e", "VLLM_API_KEY=${K}", "img"]),
    ],
)  # fmt: skip
def test_every_spelling_of_the_key_on_a_command_line_is_masked(
    argv: list[str], masked: list[str]
) -> None:
    assert apikey.mask_argv(argv) == tuple(masked)


def test_the_key_comes_from_the_command_line_else_the_units_environment(tmp_path: Path) -> None:
    env_file = tmp_path / "vllm.env"
    env_file.write_text(f"# vLLM's settings\nHF_HOME=/x\nVLLM_API_KEY='{KEY}-file'\n")
    argv = ["vllm", "serve", "m", f"--api-key={KEY}-argv"]
    environment = ["HOME=/var/lib/vllm", f"VLLM_API_KEY={KEY}-env"]
    files = [str(tmp_path / "missing.env"), str(env_file)]
    found = apikey.from_unit(argv, environment, files)
    assert found == ApiKey(f"{KEY}-argv", "the unit's --api-key")
    # As systemd does, an EnvironmentFile= wins over Environment=.
    found = apikey.from_unit(argv[:3], environment, files)
    assert found == ApiKey(f"{KEY}-file", f"VLLM_API_KEY in EnvironmentFile={env_file}")
    found = apikey.from_unit(argv[:3], environment, files[:1])
    assert found == ApiKey(f"{KEY}-env", "the unit's Environment=VLLM_API_KEY")
    assert apikey.from_unit(argv[:3], environment[:1], files[:1]) is None
    assert KEY not in repr(found)


def test_a_reference_on_the_command_line_reads_the_variable_as_systemd_would(
    tmp_path: Path,
) -> None:
    first, second = tmp_path / "a.env", tmp_path / "b.env"
    first.write_text(f"KEY={KEY}-a\n")
    second.write_text(f'KEY="{KEY}-b"\n')
    argv = ["vllm", "serve", "m", "--api-key", "${KEY}"]
    environment = [f"KEY={KEY}-env", "VLLM_API_KEY=not-this-one"]
    # A file's assignment wins over Environment=, a later file's over an earlier one's.
    assert apikey.from_unit(argv, environment, [str(first), str(second)]) == ApiKey(
        f"{KEY}-b", f"${{KEY}} on the unit's command line, KEY in EnvironmentFile={second}"
    )
    assert apikey.from_unit(argv, environment, []) == ApiKey(
        f"{KEY}-env", "${KEY} on the unit's command line, the unit's Environment=KEY"
    )
    assert apikey.from_unit(argv, ["VLLM_API_KEY=x"], []) is None  # KEY is unset: no key
    assert not apikey.spelled_out(argv) and apikey.spelled_out(apikey.mask_argv([*argv[:4], "k"]))
    flags = apply_flags(argv, {"max-num-seqs": 8})  # nothing secret to copy
    assert flags[:5] == argv and flags[5:] == ["--max-num-seqs", "8"]


def test_a_container_engines_environment_for_vllm_gives_the_key() -> None:
    argv = ["podman", "run", "--rm", "-e", f"VLLM_API_KEY={KEY}", "img", "--model", "m"]
    assert apikey.from_unit(argv, [], []) == ApiKey(
        KEY, "the unit's VLLM_API_KEY= on its command line"
    )
    with pytest.raises(VllmCommandError, match="spells out"):
        apply_flags(apikey.mask_argv(argv), {"max-num-seqs": 8})


def test_a_key_file_only_its_owner_may_read(tmp_path: Path) -> None:
    path = tmp_path / "vllm.key"
    path.write_text(f"{KEY}\n")
    path.chmod(0o600)
    assert apikey.read_key_file(str(path)) == ApiKey(KEY, f"[vllm] api_key_file {path}")
    for mode, said in ((0o644, "mode 0644); chmod 600 it"), (0o640, "mode 0640")):
        path.chmod(mode)
        with pytest.raises(KeyFileError, match="group or others may read it") as caught:
            apikey.read_key_file(str(path))
        assert said in str(caught.value) and KEY not in str(caught.value)
    path.chmod(0o600)
    link = tmp_path / "link.key"
    link.symlink_to(path)
    with pytest.raises(KeyFileError, match=r"link\.key"):
        apikey.read_key_file(str(link))
    empty = tmp_path / "empty.key"
    empty.write_text("\n")
    empty.chmod(0o600)
    with pytest.raises(KeyFileError, match="empty"):
        apikey.read_key_file(str(empty))
    with pytest.raises(KeyFileError, match="No such file"):
        apikey.read_key_file(str(tmp_path / "none"))


def test_a_key_read_once_is_blanked_out_of_every_event() -> None:
    apikey.remember(ApiKey(KEY, "test"))
    stream = io.StringIO()
    events = Events(stream=stream)
    events.emit(
        "unit.exited",
        f"vllm.service exited: non-default args: {{'api_key': ['{KEY}']}}",
        error=f"--api-key {KEY}",
        argv=["vllm", "serve", KEY],
    )
    line = json.loads(stream.getvalue())
    assert KEY not in stream.getvalue()
    assert line["argv"] == ["vllm", "serve", MASKED] and MASKED in line["message"]


def test_flags_are_not_rewritten_on_a_command_line_that_carries_the_key() -> None:
    argv = apikey.mask_argv(["vllm", "serve", "m", "--api-key", KEY])
    with pytest.raises(VllmCommandError, match="spells out vLLM's API key") as caught:
        apply_flags(argv, {"max-num-seqs": 8})
    assert KEY not in str(caught.value)


# -- on the wire ------------------------------------------------------------------------------


def completions(handler: Handler) -> None:
    """vLLM's AuthenticationMiddleware in front of a completion: 401 without the key."""
    handler.rfile.read(int(handler.headers.get("Content-Length", "0")))
    if handler.headers.get("Authorization") != f"Bearer {KEY}":
        handler.reply(401, b'{"error": "Unauthorized"}', content_type="application/json")
    else:
        handler.reply(200, b'{"choices": [{"text": " the"}]}', content_type="application/json")


def probe(client: VllmClient) -> tuple[str, str]:
    prober = Prober(client)
    assert prober.send("tiny-llama")
    prober.wait(10)
    assert prober.last is not None
    return prober.last.outcome, prober.last.detail


def test_the_probe_carries_the_key_and_a_401_names_the_configuration() -> None:
    with HttpServer({"/v1/completions": completions}) as server:
        assert probe(VllmClient(server.url, api_key=ApiKey(KEY, "the unit's --api-key"))) == (
            "ok",
            "",
        )
        outcome, detail = probe(VllmClient(server.url))
        assert outcome == "unusable"
        assert "HTTP 401" in detail and "vLLM wants an API key and vkvagent found none" in detail
        wrong = ApiKey("sk-wrong", "[vllm] api_key_file /etc/vkvagent/vllm.key")
        outcome, detail = probe(VllmClient(server.url, api_key=wrong))
        assert outcome == "unusable" and "sk-wrong" not in detail
        assert "refuses the API key from [vllm] api_key_file /etc/vkvagent/vllm.key" in detail
        assert "a configuration problem" in detail
    assert [h.get("Authorization") for _path, h in server.requests] == [
        f"Bearer {KEY}", None, "Bearer sk-wrong",
    ]  # fmt: skip


def test_https_is_verified_against_the_operators_ca(tmp_path: Path) -> None:
    files = make_certificates(tmp_path)
    page = b"vllm:num_requests_running 0\n"
    with HttpServer({"/metrics": lambda h: h.reply(200, page)}) as server:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(files["server"], files["server-key"])
        server.socket = context.wrap_socket(server.socket, server_side=True)
        url = f"https://127.0.0.1:{server.port}"
        metrics = VllmClient(url, ca_file=str(files["ca"])).scrape()
        assert metrics.num_requests_running == 0
        with pytest.raises(ScrapeError) as caught:
            VllmClient(url, connect_timeout=2).scrape()
        said = str(caught.value)
        assert "certificate is not trusted" in said and "set [vllm] ca_file" in said, said
        assert "\n" not in said
    assert os.path.exists(files["ca"])
