"""A test CA and the certificates it signs, made with openssl for each test that speaks TLS."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest


def make_certificates(directory: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, with openssl."""
    if shutil.which("openssl") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("openssl not found (CI=true: not skipped)")
        pytest.skip("openssl not found")
    files = {name: directory / f"{name}.pem" for name in ("ca", "ca-key", "server", "server-key",
                                                          "client", "client-key")}  # fmt: skip
    # The extensions a real CA and its leaves carry: Python 3.13 verifies strictly
    # (VERIFY_X509_STRICT), and refuses a CA without keyUsage or a leaf without its AKI.
    ext = directory / "ext.cnf"
    ext.write_text(
        "basicConstraints = critical, CA:FALSE\n"
        "keyUsage = critical, digitalSignature\n"
        "extendedKeyUsage = serverAuth, clientAuth\n"
        "subjectAltName = IP:127.0.0.1\n"
        "subjectKeyIdentifier = hash\n"
        "authorityKeyIdentifier = keyid\n"
    )

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=directory)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl("req", "-x509", *ec, "-keyout", str(files["ca-key"]), "-out", str(files["ca"]),
            "-days", "1", "-subj", "/CN=vkvagent test CA",
            "-addext", "basicConstraints = critical, CA:TRUE",
            "-addext", "keyUsage = critical, keyCertSign, cRLSign")  # fmt: skip
    for name in ("server", "client"):
        csr = directory / f"{name}.csr"
        openssl("req", *ec, "-keyout", str(files[f"{name}-key"]), "-out", str(csr),
                "-subj", f"/CN={name}")  # fmt: skip
        openssl("x509", "-req", "-in", str(csr), "-CA", str(files["ca"]), "-CAkey",
                str(files["ca-key"]), "-CAcreateserial", "-days", "1", "-extfile", str(ext),
                "-out", str(files[name]))  # fmt: skip
    return files
