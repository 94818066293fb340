"""Config validation holds the limits `serve` and the wire depend on: alias bombs and deep
nesting, the wire's request size, the default generation limit, and every host rule
`serve` applies (TLS files, state_dir, listener ports)."""

from __future__ import annotations

import ssl
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from iop_edge.core.configuration.config import ConfigInvalid, parse_config
from iop_edge.runtime.lifecycle.host_checks import node_tls_context
from iop_edge.runtime.refresh.config_file import check_config
from schemas.config import DEFAULT_MAX_TOKENS_LIMIT, TlsSection
from schemas.limits import MAX_PAYLOAD_BYTES
from schemas.runtime import safe_yaml
from tests.unit.test_config import valid


def _errors(text: str) -> list[str]:
    with pytest.raises(ConfigInvalid) as invalid:
        check_config(text)
    return [str(error) for error in invalid.value.errors]


def _text(**sections: object) -> str:
    return yaml.safe_dump({**valid(), **sections})


def _bomb(levels: int) -> str:
    """`levels` anchors, each a list of ten aliases of the previous: 10^levels leaves."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for level in range(1, levels):
        lines.append(f"a{level}: &a{level} [" + ", ".join([f"*a{level - 1}"] * 10) + "]")
    return "\n".join(lines)


def test_an_alias_bomb_inside_a_free_form_map_is_refused_quickly() -> None:
    bomb = _bomb(8)  # 10^8 leaves: the next request would have encoded all of them
    text = (
        "x-bomb-anchors:\n"
        + "\n".join("  " + line for line in bomb.splitlines())
        + "\n"
        + _text().replace("- id: m1\n", "- id: m1\n  generation: {defaults: {stop: *a7}}\n")
    )
    started = time.perf_counter()
    errors = _errors(text)
    assert time.perf_counter() - started < 5  # refused while counting, never expanded
    assert len(errors) == 1 and "aliases expand this document" in errors[0], errors


def test_sharing_a_block_with_aliases_stays_allowed() -> None:
    text = _text().replace("- id: m1\n", "- id: m1\n  generation: {defaults: &d {t: 1}}\n")
    text += "x: [*d, *d, *d]\n"  # unknown key: refused for being unknown, not for the alias
    assert all("aliases" not in error for error in _errors(text))


def test_yaml_nested_past_the_depth_limit_is_refused() -> None:
    deep = "k: " + "[" * (safe_yaml.MAX_DEPTH + 5) + "]" * (safe_yaml.MAX_DEPTH + 5)
    errors = _errors(deep)
    assert len(errors) == 1 and "nested deeper than" in errors[0]
    with pytest.raises(yaml.YAMLError):
        safe_yaml.load("[" * 100_000)  # a RecursionError before the bound existed


def test_max_request_bytes_is_bounded_by_what_the_wire_carries() -> None:
    fits = yaml.safe_dump({**valid(), "openai": {"max_request_bytes": MAX_PAYLOAD_BYTES}})
    assert parse_config(fits).config.openai.max_request_bytes == MAX_PAYLOAD_BYTES
    errors = _errors(_text(openai={"max_request_bytes": 66 * 1024 * 1024}))
    assert errors == [f"openai.max_request_bytes: must be <= {MAX_PAYLOAD_BYTES}"]


def test_a_model_without_a_limit_gets_the_default_max_tokens_limit() -> None:
    config = parse_config(_text()).config
    assert config.models[0].generation.max_tokens_limit == DEFAULT_MAX_TOKENS_LIMIT
    raw = valid()
    raw["models"][0]["generation"] = {"max_tokens_limit": None}  # no way to unbound it
    assert "max_tokens_limit" in _errors(yaml.safe_dump(raw))[0]


def test_listeners_on_one_port_are_refused() -> None:
    errors = _errors(
        _text(
            edge={"listen": "0.0.0.0:7700"},
            admin={"listen": "127.0.0.1:7700"},
            openai={"listen": "127.0.0.1:0"},
        )
    )
    assert errors == ["admin.listen: 127.0.0.1:7700 is also edge.listen: each listener needs "
                      "its own port"]  # fmt: skip
    parse_config(_text(admin={"listen": "127.0.0.1:0"}, openai={"listen": "127.0.0.1:0"}))


def test_state_dir_must_be_a_directory(tmp_path: Path) -> None:
    taken = tmp_path / "a-file"
    taken.write_text("not a directory")
    errors = _errors(_text(edge={"state_dir": str(taken)}))
    assert errors == [f"edge.state_dir: {taken} exists and is not a directory"]
    check_config(_text(edge={"state_dir": str(tmp_path / "new" / "deeper")}))  # creatable


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("tls")
    files = {name: folder / f"{name}.pem" for name in ("cert", "key", "encrypted", "other")}
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-keyout", files["key"], "-out", files["cert"]],
        check=True, capture_output=True,
    )  # fmt: skip
    subprocess.run(
        ["openssl", "rsa", "-in", files["key"], "-aes256", "-passout", "pass:x",
         "-out", files["encrypted"]],
        check=True, capture_output=True,
    )  # fmt: skip
    subprocess.run(
        ["openssl", "genrsa", "-out", files["other"], "2048"], check=True, capture_output=True
    )
    return files


def test_tls_files_are_loaded_at_validation_as_serve_loads_them(
    tls_files: dict[str, Path], tmp_path: Path
) -> None:
    def tls(key: Path, cert: Path | None = None) -> str:
        return _text(edge={"tls": {"cert_file": str(cert or tls_files["cert"]),
                                   "key_file": str(key)}})  # fmt: skip

    assert check_config(tls(tls_files["key"])).config.edge.tls is not None
    assert isinstance(
        node_tls_context(
            TlsSection(cert_file=str(tls_files["cert"]), key_file=str(tls_files["key"]))
        ),
        ssl.SSLContext,
    )
    (missing,) = _errors(tls(tmp_path / "missing.pem"))
    assert missing.startswith("edge.tls: cannot read") and "No such file" in missing
    (encrypted,) = _errors(tls(tls_files["encrypted"]))
    assert "passphrase" in encrypted
    (mismatch,) = _errors(tls(tls_files["other"]))
    assert "must belong to the certificate" in mismatch
    (not_pem,) = _errors(tls(tls_files["key"], cert=tmp_path / "x.pem"))
    assert "cannot read" in not_pem
