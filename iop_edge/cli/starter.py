"""`iop-edge init`: a starter Edge config with a fresh node token, for a user who installed
the package and has no repository to copy a config from.

Rules:
1. The token is made here (`secrets`, 256 bits), printed once, and stored nowhere: the file
   gets only its sha256, like every token in an Edge config (design §2.3). Whoever runs
   `init` carries the token to the Node (an env var, a file, a systemd credential).
2. An existing config is never overwritten unless asked (`--force`): it may hold the only
   record of tokens that Nodes and callers present today.
3. What is written is checked with every rule `serve` applies before it lands, and it
   lands whole (a temporary file renamed into place) or not at all.
4. The starter serves before any GPU is involved: one `sim` provider on the one node, with
   real providers as comments to uncomment.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import tempfile
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from string import Template
from typing import Final

from iop_edge.core.configuration.config import ParsedConfig
from iop_edge.core.configuration.tokens import hash_token
from iop_edge.runtime.refresh.config_file import check_config

CONFIG_NAME: Final = "edge.yaml"
DEFAULT_NODE_ID: Final = "node-1"
#: Node ids init accepts: they also name the node's providers (`ID-sim`), and must be
#: plain YAML scalars in the template.
NODE_ID: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
#: A prefix that says what the secret is when it turns up somewhere (a secret scanner, a
#: paste); the rest is 256 random bits.
TOKEN_PREFIX: Final = "iop-node-"


class StarterError(Exception):
    """`init` cannot write the config; the message says what to do instead."""


@dataclass(frozen=True, slots=True)
class Starter:
    """What `init` wrote: the file, and the token that exists nowhere else."""

    path: Path
    node_id: str
    node_token: str = field(repr=False)
    parsed: ParsedConfig = field(repr=False)


def new_node_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def render(node_id: str, node_token: str) -> str:
    """The starter config's text for this node and token (only the token's hash in it)."""
    template = (resources.files(__package__) / "starter.yaml").read_text(encoding="utf-8")
    return Template(template).substitute(node_id=node_id, node_token_sha256=hash_token(node_token))


def write_starter(
    directory: Path, *, node_id: str = DEFAULT_NODE_ID, force: bool = False
) -> Starter:
    """Write `directory/edge.yaml` (Rules 1-3); raise `StarterError`."""
    if not NODE_ID.fullmatch(node_id):
        raise StarterError(
            f"--node-id {node_id!r}: use letters, digits, '.', '_' and '-' (at most 63), "
            "starting with a letter or digit"
        )
    path = directory / CONFIG_NAME
    if path.exists() and not force:
        raise StarterError(
            f"{path} exists; init never overwrites a config (it may hold the only record of "
            "tokens in use). Pick another folder, or pass --force to replace it"
        )
    if directory.exists() and not directory.is_dir():
        raise StarterError(f"{directory} is not a folder")
    token = new_node_token()
    text = render(node_id, token)
    parsed = check_config(text)  # Rule 3: a template bug fails here, not at `serve`
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _write_whole(path, text, replace=force)
    except FileExistsError:
        raise StarterError(f"{path} appeared while init ran; it is left as it is") from None
    except OSError as exc:
        raise StarterError(f"cannot write {path}: {exc.strerror or exc}") from None
    return Starter(path=path, node_id=node_id, node_token=token, parsed=parsed)


def _write_whole(path: Path, text: str, *, replace: bool) -> None:
    """Write through a temporary file in the same folder, then link or rename it into
    place: a reader never sees half a file, and without `replace` a file that appeared
    meanwhile is kept (`os.link` fails with `FileExistsError`)."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        # Readable by the service's user (it holds hashes, no secret); mkstemp made it 0600.
        os.chmod(temporary, 0o644)
        if replace:
            os.replace(temporary, path)
        else:
            os.link(temporary, path)
    finally:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass


def report(starter: Starter) -> str:
    """What `init` prints: the file, the token (its only appearance), the next commands."""
    config = starter.parsed.config
    # The starter listens on loopback addresses, which are also what a client here dials.
    node_url = f"ws://{config.edge.listen}"
    openai_url = f"http://{config.openai.listen}/v1"
    model = config.models[0].id
    folder = starter.path.parent
    in_folder = "" if folder == Path() else f"cd {shlex.quote(str(folder))} && "
    body = '{"model": "' + model + '", "messages": [{"role": "user", "content": "Hello!"}]}'
    return f"""\
Wrote {starter.path}: node '{starter.node_id}' serving model '{model}' from the built-in
simulated engine; add your runtime's provider there when this works.

The token of node '{starter.node_id}', shown this once (the file keeps only its sha256):

    {starter.node_token}

Next:
  iop-edge check-config {shlex.quote(str(starter.path))}
  {in_folder}iop-edge serve --config {CONFIG_NAME}

  # in a second terminal (on another host: the Edge's address, and edge.listen opened up):
  read -rs IOP_NODE_TOKEN && export IOP_NODE_TOKEN    # paste the token above, Enter
  iop-node run --edge {node_url} --node-id {starter.node_id}

  # and a request:
  curl -s {openai_url}/chat/completions -H 'Content-Type: application/json' \\
    -d '{body}'

As services: iop-edge example iop-edge.service, iop-node example iop-node.service.
"""
