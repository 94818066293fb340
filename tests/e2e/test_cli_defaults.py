"""What the installed `iop-edge` reads when it is told nothing (`cli.config_lookup`):
`./edge.yaml`, else `/etc/iop/edge.yaml`, and it says which; and what `check-config`
warns about in a valid config (`core.configuration.exposure`).

`/etc/iop/edge.yaml` is a file of the test's own here (the machine's is not ours to
write); the lookup's order and messages are the same.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from iop_edge.cli import config_lookup, main
from tests.e2e.stack import edge_config, sim_provider

#: The sentence that says a config file was read although none was named.
USING = "iop-edge: using the config {} (no --config given)"


def run_cli(*argv: str) -> int:
    """The command in this thread: the tests are synchronous, and `serve` runs Trio."""
    return main(list(argv))


@pytest.fixture
def etc_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The second place looked at, in the test's folder; the test runs in `here/`."""
    etc = tmp_path / "etc" / "iop" / "edge.yaml"
    etc.parent.mkdir(parents=True)
    monkeypatch.setattr(config_lookup, "DEFAULT_CONFIGS", (Path("edge.yaml"), etc))
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    return etc


def _config(tmp_path: Path, *, openai: dict[str, Any] | None = None) -> str:
    return edge_config(
        tmp_path / "var",
        providers=[sim_provider("sim-a")],
        models=[{"id": "m", "providers": {"sim-a": "sim-small"}}],
        openai_section=openai,
    )


#: A config that `serve` refuses at once, naming the file it read: proof of which one.
BROKEN = "edge: {id: e, listen: 127.0.0.1:0}\nnot_a_section: 1\n"


def test_serve_reads_edge_yaml_here_first_and_says_so(
    etc_config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    Path("edge.yaml").write_text(BROKEN, encoding="utf-8")
    etc_config.write_text(BROKEN, encoding="utf-8")
    assert run_cli("serve", "--log-level", "error") == 1
    err = capsys.readouterr().err
    assert err.startswith(USING.format("./edge.yaml") + "\n")
    assert "iop-edge: error: edge.yaml: invalid config" in err
    assert str(etc_config) not in err


def test_serve_reads_etc_iop_when_there_is_none_here(
    etc_config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    etc_config.write_text(BROKEN, encoding="utf-8")
    assert run_cli("serve", "--log-level", "error") == 1
    err = capsys.readouterr().err
    assert err.startswith(USING.format(etc_config) + "\n")
    assert f"iop-edge: error: {etc_config}: invalid config" in err


def test_with_no_config_anywhere_serve_names_where_it_looked(
    etc_config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli("serve") == 1
    err = capsys.readouterr().err
    assert err == (
        f"iop-edge: error: no --config given, and there is no ./edge.yaml nor {etc_config} "
        f"(./ is {Path.cwd()}). Pass --config FILE, or write one here with `iop-edge init`\n"
    )


def test_admin_commands_find_the_edge_through_the_same_default(
    etc_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    etc_config.write_text(_config(tmp_path), encoding="utf-8")  # admin.listen 127.0.0.1:0
    assert run_cli("catalog") == 1
    err = capsys.readouterr().err
    assert err.startswith(USING.format(etc_config) + "\n")
    assert f"{etc_config} has admin.listen 127.0.0.1:0" in err  # read from that file

    etc_config.unlink()
    assert run_cli("usage") == 1
    err = capsys.readouterr().err
    assert f"there is no ./edge.yaml nor {etc_config}" in err
    assert "Pass --admin http://127.0.0.1:7701" in err and "--config" in err


def test_help_names_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "default: ./edge.yaml, else /etc/iop/edge.yaml, the first that exists" in help_text
    assert "configs/edge.yaml" not in help_text


# --- check-config: an open caller API ----------------------------------------------------------


@pytest.mark.parametrize(
    ("openai", "warned"),
    [
        ({"listen": "0.0.0.0:8080"}, True),
        ({"listen": "[::]:8080"}, True),
        ({"listen": "192.0.2.10:8080"}, True),
        ({"listen": "127.0.0.1:8080"}, False),
        ({"listen": "localhost:8080"}, False),
        (
            {
                "listen": "0.0.0.0:8080",
                "principal_tokens": [
                    {
                        "token_ref": "alice-laptop",
                        "principal_ref": "alice",
                        "token_hash_sha256": "ab" * 32,
                    }
                ],
            },
            False,
        ),
    ],
)
def test_check_config_warns_of_an_open_caller_api_on_other_machines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], openai: dict[str, Any], warned: bool
) -> None:
    path = tmp_path / "edge.yaml"
    path.write_text(_config(tmp_path, openai=openai), encoding="utf-8")
    assert run_cli("check-config", "--offline", str(path)) == 0  # valid all the same
    captured = capsys.readouterr()
    assert captured.out.startswith(f"{path}: OK")
    warnings = [line for line in captured.err.splitlines() if "openai.listen" in line]
    if not warned:
        assert warnings == []
        return
    listen = openai["listen"]
    assert warnings == [
        f"warning: openai.listen: {listen} is not a loopback address and "
        "openai.principal_tokens is empty: anyone who reaches this port can call every "
        "model, unauthenticated (as the principal 'anonymous'). Add openai.principal_tokens "
        "(docs/configuration.md, Tokens), or listen on 127.0.0.1"
    ]


def test_a_config_without_openai_listen_is_open_on_every_interface(tmp_path: Path) -> None:
    """The default `openai.listen` is 0.0.0.0:8080: a config that says nothing is warned."""
    from iop_edge.core.configuration.config import parse_config
    from iop_edge.core.configuration.exposure import exposure_warnings

    doc = yaml.safe_load(_config(tmp_path))
    del doc["openai"]["listen"]
    warnings = exposure_warnings(parse_config(yaml.safe_dump(doc)).config)
    assert len(warnings) == 1 and warnings[0].startswith("openai.listen: 0.0.0.0:8080 is not")


def test_a_command_that_looks_twice_says_once_which_default_it_uses(
    etc_config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    etc_config.write_text("edge: {}\n")
    for _ in range(2):
        config_lookup.forget_announced()  # as `main` does for each command
        for _ in range(2):
            assert config_lookup.config_or_default(None, advice="") == etc_config
    assert capsys.readouterr().err == (USING.format(etc_config) + "\n") * 2
