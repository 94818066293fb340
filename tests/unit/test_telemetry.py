"""Trace settings (`schemas.runtime.telemetry`): off by default, the config over the standard
`OTEL_*` variables, errors that name the setting; the GenAI vocabulary; and tracing that
is off costs no OpenTelemetry import."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest

from iop_edge.core.configuration.config import ConfigInvalid, parse_config
from iop_node.cli import TELEMETRY_FLAGS, build_parser, resolve_invocation
from schemas.config import AdapterSettings, ProviderConfig, TelemetrySection
from schemas.runtime.spans import start_tracing
from schemas.runtime.telemetry import (
    TelemetryError,
    TelemetryUnavailable,
    TraceSettings,
    provider_name,
    trace_settings,
    valid_traceparent,
)

NAMES = {name: f"edge.telemetry.{name}" for name in TELEMETRY_FLAGS}
ROOT = Path(__file__).resolve().parents[2]


def settings(section: TelemetrySection | None = None, **environ: str) -> TraceSettings | None:
    return trace_settings(section, environ, default_service="iop-edge", names=NAMES)


def test_off_unless_an_endpoint_is_set() -> None:
    assert settings() is None
    assert settings(OTEL_SERVICE_NAME="x", OTEL_TRACES_SAMPLER="always_on") is None


def test_the_standard_variables_turn_it_on_with_the_standard_defaults() -> None:
    base = settings(OTEL_EXPORTER_OTLP_ENDPOINT="http://collector:4318/")
    assert base == TraceSettings(
        endpoint="http://collector:4318/v1/traces",
        sampler="parentbased_always_on",
        sampler_arg=1.0,
        service_name="iop-edge",
        source="OTEL_EXPORTER_OTLP_ENDPOINT",
    )
    # The signal's own endpoint is used as it is, and wins over the base one.
    traces = settings(
        OTEL_EXPORTER_OTLP_ENDPOINT="http://collector:4318",
        OTEL_EXPORTER_OTLP_TRACES_ENDPOINT="https://tempo.example:443/otlp/traces",
        OTEL_TRACES_SAMPLER="parentbased_traceidratio",
        OTEL_TRACES_SAMPLER_ARG="0.25",
        OTEL_SERVICE_NAME="gateway",
    )
    assert traces is not None
    assert traces.endpoint == "https://tempo.example:443/otlp/traces"
    assert (traces.sampler, traces.sampler_arg, traces.service_name) == (
        "parentbased_traceidratio",
        0.25,
        "gateway",
    )


def test_the_config_wins_over_the_variables_and_the_sdk_switch_wins_over_both() -> None:
    section = TelemetrySection(
        endpoint="http://jaeger:4318", sampler="always_on", service_name="edge-eu"
    )
    environ = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://elsewhere:4318",
        "OTEL_TRACES_SAMPLER": "always_off",
        "OTEL_SERVICE_NAME": "other",
    }
    chosen = settings(section, **environ)
    assert chosen is not None
    assert (chosen.endpoint, chosen.sampler, chosen.service_name) == (
        "http://jaeger:4318/v1/traces",
        "always_on",
        "edge-eu",
    )
    assert chosen.source == "edge.telemetry.endpoint"
    # A full traces URL in the config is kept as it is.
    full = settings(TelemetrySection(endpoint="http://c:4318/v1/traces/"))
    assert full is not None and full.endpoint == "http://c:4318/v1/traces"
    assert settings(section, OTEL_SDK_DISABLED="TRUE") is None


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "OTEL_EXPORTER_OTLP_PROTOCOL=grpc"),
        ({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}, "TRACES_PROTOCOL=http/json"),
        ({"OTEL_TRACES_SAMPLER": "jaeger_remote"}, "OTEL_TRACES_SAMPLER=jaeger_remote"),
        (
            {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"},
            "OTEL_TRACES_SAMPLER_ARG=2",
        ),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
    ],
)
def test_a_bad_variable_is_refused_by_name(environ: dict[str, str], named: str) -> None:
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", **environ}
    with pytest.raises(TelemetryError, match=named):
        settings(**environ)


def test_the_config_checks_the_endpoint_and_its_shape_with_paths() -> None:
    base = "openai: {listen: '127.0.0.1:0'}\nadmin: {listen: '127.0.0.1:0'}\n"
    with pytest.raises(ConfigInvalid) as caught:
        parse_config(base + "edge: {telemetry: {endpoint: 'collector:4318'}}\n")
    assert [e.path for e in caught.value.errors] == ["edge.telemetry.endpoint"]
    with pytest.raises(ConfigInvalid) as caught:
        parse_config(
            base + "edge: {telemetry: {protocol: grpc, sampler_arg: 3, sampler: sometimes}}\n"
        )
    paths = sorted(e.path for e in caught.value.errors)
    assert paths == [
        "edge.telemetry.protocol",
        "edge.telemetry.sampler",
        "edge.telemetry.sampler_arg",
    ]
    parsed = parse_config(base + "edge: {telemetry: {endpoint: 'http://otel:4318'}}\n")
    assert parsed.config.edge.telemetry.endpoint == "http://otel:4318"


def test_the_node_flags_win_over_its_config_file(tmp_path: Path) -> None:
    config = tmp_path / "node.yaml"
    config.write_text(
        "edge: ws://edge:7700\nnode_id: n1\n"
        "telemetry: {endpoint: 'http://file:4318', service_name: from-file}\n"
    )
    flags = ["--otlp-endpoint", "http://flag:4318", "--trace-sampler", "traceidratio"]
    args = build_parser().parse_args(
        ["run", "--config", str(config), *flags, "--trace-sampler-arg", "0.5"]
    )
    invocation = resolve_invocation(args, {"IOP_NODE_TOKEN": "t"})
    assert invocation.telemetry == TelemetrySection(
        endpoint="http://flag:4318",
        sampler="traceidratio",
        sampler_arg=0.5,
        service_name="from-file",
    )
    with pytest.raises(SystemExit):  # argparse refuses a ratio out of range
        build_parser().parse_args(["run", "--trace-sampler-arg", "1.5"])


def _provider(type_: str, base_url: str | None = None) -> ProviderConfig:
    raw = {"id": "p", "type": type_, "models": ["x"], "capacity": 1}
    return msgspec.convert(
        {**raw, "adapter": msgspec.to_builtins(AdapterSettings(base_url=base_url))},
        ProviderConfig,
    )


def test_provider_names_follow_the_conventions_well_known_values() -> None:
    assert provider_name(_provider("vllm", "http://gpu:8000/v1")) == "vllm"
    assert provider_name(_provider("ollama")) == "ollama"
    assert provider_name(_provider("openai_api", "https://api.openai.com/v1")) == "openai"
    assert provider_name(_provider("openai_api", "https://api.groq.com/openai/v1")) == "groq"
    assert provider_name(_provider("openai_api", "https://llm.internal/v1")) == "openai_api"


def test_traceparent_validation() -> None:
    good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert valid_traceparent(good)
    assert valid_traceparent("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-later")
    for bad in (
        "",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
    ):
        assert not valid_traceparent(bad), bad


def test_tracing_off_imports_no_opentelemetry_module(tmp_path: Path) -> None:
    """The whole run path, Edge and Node, built and serving one request without an
    endpoint: not one OpenTelemetry module is loaded."""
    script = textwrap.dedent(
        """
        import sys, trio
        from pathlib import Path
        from tests.e2e.stack import one_sim_config, start_stack

        async def main():
            async with trio.open_nursery() as nursery:
                tmp = Path(sys.argv[1])
                stack = await start_stack(
                    nursery, one_sim_config(tmp), tmp / "edge.yaml", wait_models=("m",)
                )
                assert stack.edge.tracing is None
                async with stack.http() as http:
                    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                    reply = await http.post("/v1/chat/completions", json=body)
                    assert reply.status_code == 200, reply.text
                nursery.cancel_scope.cancel()

        trio.run(main)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")
        print(loaded)
        """
    )
    environ = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(ROOT),
        "HOME": str(tmp_path),
    }
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=environ,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_tracing_without_the_sdk_says_which_extra_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    chosen = settings(OTEL_EXPORTER_OTLP_ENDPOINT="http://collector:4318")
    assert chosen is not None
    # As when the package is absent: importing it fails (and the module that uses it is
    # imported afresh, as in a process that never traced).
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace.export", None)
    monkeypatch.delitem(sys.modules, "schemas.runtime.compat.otlp_http", raising=False)
    with pytest.raises(
        TelemetryUnavailable, match=r"OTEL_EXPORTER_OTLP_ENDPOINT.*iop-gateway\[otel\]"
    ):
        start_tracing(chosen, instance_id="edge/1", version="0")
