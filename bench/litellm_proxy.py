"""LiteLLM's proxy, the most used open LLM gateway, as the comparison target (optional).

LiteLLM is not a dependency of IOP. The bench uses it when it finds the executable: the
path in `IOP_BENCH_LITELLM`, else `litellm` on `PATH`. To enable it, install it into a
separate virtualenv (its dependency tree is large and pins versions of its own):

    python3 -m venv /tmp/litellm-venv
    /tmp/litellm-venv/bin/pip install 'litellm[proxy]'
    IOP_BENCH_LITELLM=/tmp/litellm-venv/bin/litellm just bench

It is configured like the IOP gateway under test: `bench-model` on the same upstream
(`openai/` provider prefix = any OpenAI-compatible server), and, for the Anthropic
Messages and OpenAI Responses scenarios, `bench-model-translated` on it through LiteLLM's
`custom_openai/` provider, which LiteLLM serves by translating both protocols to chat
completions and back, as IOP's Node does for a chat-only provider (with `openai/`
LiteLLM would instead send both protocols to the upstream's own `/v1/responses`); one
worker process (the IOP Edge is one process too), no authentication (the IOP config
under test has no principal tokens either), no network fetch of its model price map,
and uvicorn's access log off so neither side pays for per-request logging.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Any, Final

import trio
import yaml

from bench.services import Service, start_service
from bench.upstream import MODEL, MODEL_TRANSLATED, SERVED_MODEL

ENV_VAR: Final = "IOP_BENCH_LITELLM"
_READY = re.compile(r"Uvicorn running on (http://\S+)")
_CHILD_ENV: Final = {
    # No master key: every request accepted, as in IOP's config without principal tokens.
    "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true",
    # Use the bundled price map and notes instead of fetching them from the internet.
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_LOCAL_BLOG_POSTS": "true",
    "LITELLM_LOG": "WARNING",
}
#: uvicorn logging: its startup lines (the readiness signal) on, the access log off.
_LOG_CONFIG: Final[dict[str, Any]] = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(levelname)s: %(message)s"}},
    "handlers": {
        "stderr": {
            "class": "logging.StreamHandler",
            "formatter": "plain",
            "stream": "ext://sys.stderr",
        }
    },
    "loggers": {
        "uvicorn": {"handlers": ["stderr"], "level": "INFO", "propagate": False},
        "uvicorn.error": {"level": "INFO"},
        "uvicorn.access": {"handlers": ["stderr"], "level": "WARNING", "propagate": False},
    },
}


def find_litellm() -> str | None:
    """The LiteLLM executable to use, or None when it is not installed."""
    configured = os.environ.get(ENV_VAR)
    if configured:
        return configured if Path(configured).is_file() else None
    return shutil.which("litellm")


def litellm_config(upstream_root: str) -> str:
    """LiteLLM's proxy config: `bench-model` and `bench-model-translated` on the bench
    upstream (see the module docstring)."""
    config = {
        "model_list": [
            {
                "model_name": name,
                "litellm_params": {
                    "model": f"{provider}/{SERVED_MODEL}",
                    "api_base": f"{upstream_root}/v1",
                    "api_key": "unused",
                },
            }
            for name, provider in ((MODEL, "openai"), (MODEL_TRANSLATED, "custom_openai"))
        ]
    }
    return yaml.safe_dump(config, sort_keys=False)


def _free_port() -> int:
    """A port free right now. LiteLLM cannot bind port 0 and report it, so the bench picks
    one; another process could take it in between, which would fail the start loudly."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _ready(line: str) -> str | None:
    match = _READY.search(line)
    return match.group(1) if match else None


async def start_litellm(
    nursery: trio.Nursery, executable: str, upstream_root: str, workdir: Path
) -> Service[str]:
    """Start LiteLLM's proxy; its `ready` value is its root URL. Startup takes ~10 s."""
    config_path = workdir / "litellm.yaml"
    log_config_path = workdir / "litellm-logging.json"
    await trio.Path(config_path).write_text(litellm_config(upstream_root), encoding="utf-8")
    await trio.Path(log_config_path).write_text(json.dumps(_LOG_CONFIG), encoding="utf-8")
    argv = [
        executable,
        "--config", str(config_path),
        "--host", "127.0.0.1",
        "--port", str(_free_port()),
        "--num_workers", "1",
        "--log_config", str(log_config_path),
    ]  # fmt: skip
    return await start_service(nursery, "litellm", argv, _ready, env=_CHILD_ENV)
