"""The systemd units the package ships (`iop-edge example iop-edge.service`,
`iop-node example iop-node.service`): hardened, and the Edge's TLS files handed over as
credentials, as the Node's token is. `tests/install` runs their commands; this checks
what systemd would enforce, and how `systemd-analyze security` rates it where that tool
is installed (Debian: the `systemd` package).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from iop_edge.examples import read_example as edge_example
from iop_node.examples import read_example as node_example

UNITS = {
    "iop-edge.service": edge_example("iop-edge.service"),
    "iop-node.service": node_example("iop-node.service"),
}
#: Settings both units must carry, with their values.
HARDENING = {
    "DynamicUser": "yes",
    "NoNewPrivileges": "yes",
    "CapabilityBoundingSet": "",
    "AmbientCapabilities": "",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "PrivateDevices": "yes",
    "PrivateUsers": "yes",
    "PrivateMounts": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectKernelLogs": "yes",
    "ProtectControlGroups": "yes",
    "ProtectClock": "yes",
    "ProtectHostname": "yes",
    "ProtectProc": "invisible",
    "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX",
    "RestrictNamespaces": "yes",
    "RestrictRealtime": "yes",
    "RestrictSUIDSGID": "yes",
    "LockPersonality": "yes",
    "MemoryDenyWriteExecute": "yes",
    "SystemCallArchitectures": "native",
    "UMask": "0077",
}
#: `systemd-analyze security` scores 0 (locked down) to 10; below 2 reads "OK".
HIGHEST_SCORE = 2.0


def _settings(text: str) -> dict[str, list[str]]:
    """Every `Key=value` of a unit, each key's values in order (systemd appends)."""
    settings: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


@pytest.mark.parametrize("name", sorted(UNITS))
def test_the_units_are_hardened(name: str) -> None:
    settings = _settings(UNITS[name])
    assert {key: settings.get(key, [None])[-1] for key in HARDENING} == HARDENING
    assert settings["SystemCallFilter"] == ["@system-service", "~@privileged @resources"]


def test_the_edge_takes_its_tls_files_as_credentials() -> None:
    text = UNITS["iop-edge.service"]
    # Commented out: a starter config has no TLS, and a missing file would fail the start.
    assert "#LoadCredential=edge.crt:/etc/iop/tls/edge.crt" in text.splitlines()
    assert "#LoadCredential=edge.key:/etc/iop/tls/edge.key" in text.splitlines()
    assert "key_file: /run/credentials/iop-edge.service/edge.key" in text
    node = _settings(UNITS["iop-node.service"])
    assert node["LoadCredential"] == ["iop-node-token:/etc/iop/node-1.token"]


@pytest.mark.parametrize("name", sorted(UNITS))
def test_systemd_rates_the_units_ok(name: str, tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip(
            "systemd-analyze is not installed (Debian: apt-get install systemd); the units' "
            "settings are checked by test_the_units_are_hardened all the same"
        )
    unit = tmp_path / name
    unit.write_text(UNITS[name], encoding="utf-8")
    result = subprocess.run(
        [analyze, "security", "--offline=yes", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    found = re.search(
        rf"Overall exposure level for {re.escape(name)}: ([0-9.]+) (\w+)", result.stdout
    )
    if found is None:
        pytest.skip(f"this systemd-analyze cannot rate a unit file offline: {result.stderr[-300:]}")
    score, rating = float(found.group(1)), found.group(2)
    assert score < HIGHEST_SCORE and rating == "OK", result.stdout
