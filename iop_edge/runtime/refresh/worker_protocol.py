"""What the Edge and its refresh worker say to each other (`refresh.worker`).

The worker is a child process started by module name; the two speak over its stdin and
stdout in frames: a 4-byte big-endian length, then one message in MessagePack. The worker
opens with `Hello`, naming the protocol `VERSION` it speaks; an Edge that hears another
version stops the worker and fails the refresh rather than guess.

Rules:
1. One request at a time: the Edge sends `Prepare` and the frames it announces, the
   worker answers with exactly one of `Prepared`, `Invalid` or `Failed`.
2. The worker keeps the running config it last saw, by revision, and the proof of the
   last valid candidate (`core.configuration.config_proof`). A `Prepare` whose base
   revision the worker does not hold carries the base config itself: the config without
   its Nodes (`base_config`), then `base_nodes` frames of one `NodeEntry` each. The Edge
   knows which revisions the worker holds, because only its own requests tell it.
3. A built candidate comes back as a per-Node delta (`Built`): the rest of the config
   without its Nodes and every Node's id; the Nodes that changed are named by their
   position among the ids, and each follows the reply in a frame of its own, in that
   order (an unchanged Node is not sent: the Edge keeps the very object it runs). So the
   Edge neither reads nor decodes a fleet's megabytes in one step: it reads the frames a
   few hundred at a time and decodes them a Node at a time.
4. What is large goes in pieces, each its own frame, so that neither side makes or reads
   megabytes in one step: an inline candidate follows `Prepare` (after any base Nodes) as
   `text_pieces` frames of its UTF-8 text, cut at character boundaries.
5. A reply's plan comes without its long lists (`PLAN_LISTS`: its changes, changed Nodes
   and changed providers, tens of thousands each for a fleet): `Plan.lengths` says how
   long each is, and each follows the reply in frames of at most `PIECE_ITEMS` items,
   in that order, before any Node (Rule 3). The Edge decodes them a frame a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import msgspec

from schemas.config import ConfigError
from schemas.refresh import Change, RefreshError

__all__ = [
    "VERSION",
    "Built",
    "Failed",
    "Hello",
    "Invalid",
    "Plan",
    "Prepare",
    "Prepared",
    "Reply",
    "frame",
]

#: The protocol this module describes; bumped on any change to the messages.
VERSION: Final = 3
#: The frame header: the payload's length, big-endian.
HEADER_BYTES: Final = 4


class Hello(msgspec.Struct, frozen=True, tag="hello"):
    """The worker's first message."""

    version: int


class Prepare(msgspec.Struct, frozen=True, kw_only=True, tag="prepare"):
    """Read a candidate (inline text, or the file at `config_path`), check it, plan it over
    the base and, with `build`, build what would run (Rule 3)."""

    base_revision: int
    base_config: bytes | None = None
    """The base `EdgeConfig` without its Nodes, in MessagePack, when the worker does not
    hold it (Rule 2)."""
    base_nodes: int = 0
    """Frames that follow, one base `NodeEntry` each (Rule 2)."""
    text_pieces: int | None = None
    """An inline candidate: frames of its text that follow (Rule 4)."""
    config_path: str | None = None
    """Else the config file to read."""
    pending_restart: list[str] = []
    allow_restart_required: bool = False
    build: bool = False
    deadline_s: float | None = None
    """Real seconds the worker may take; past them it ends itself (`worker`, Rule 4)."""


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    """What an apply of the candidate would do (`core.refresh.refresh_plan.ApplyPlan`, its diff
    flattened): all a report needs."""

    changes: list[Change]
    changed_nodes: list[str]
    changed_providers: list[str]
    changed_models: list[str]
    pending_restart: list[str]
    errors: list[RefreshError]
    lengths: list[int] = []
    """On the wire, the lengths of the lists that follow in pieces (Rule 5), their own
    fields empty; empty once the receiving side put them in place."""
    live_paths: list[str] = []
    """The paths of the live changes: empty on the wire, made by the receiving side."""
    restart_required_paths: list[str] = []
    """The paths of the restart-required changes, likewise."""

    def __bool__(self) -> bool:
        return bool(self.changes)

    def cut(self) -> tuple[Plan, list[list[Change] | list[str]]]:
        """This plan as it goes on the wire, and its long lists, which follow (Rule 5)."""
        lists: list[list[Change] | list[str]] = [getattr(self, name) for name in PLAN_LISTS]
        cut = msgspec.structs.replace(
            self, **{name: [] for name in PLAN_LISTS}, lengths=[len(items) for items in lists]
        )
        return cut, lists

    def joined(self, lists: Sequence[list[Change] | list[str]]) -> Plan:
        """This plan from the wire with its long lists in place (Rule 5), and the paths of
        its changes by class."""
        joined = msgspec.structs.replace(self, **dict(zip(PLAN_LISTS, lists, strict=True)))
        changes = joined.changes
        return msgspec.structs.replace(
            joined,
            lengths=[],
            live_paths=[change.path for change in changes if change.class_ == "live"],
            restart_required_paths=[
                change.path for change in changes if change.class_ == "restart_required"
            ],
        )


#: The lists of a `Plan` that follow a reply in pieces, in this order (Rule 5).
PLAN_LISTS: Final = ("changes", "changed_nodes", "changed_providers")
#: The most items of a list in one frame (Rule 5).
PIECE_ITEMS: Final = 1024


class Built(msgspec.Struct, frozen=True, kw_only=True):
    """The config that would run, as a per-Node delta over the base (Rule 3)."""

    rest: bytes
    """The `EdgeConfig` without its Nodes, in MessagePack."""
    ids: list[str]
    """Every Node's id, in config order."""
    changed: list[int]
    """The positions in `ids` of the Nodes the base does not have as they are, ascending:
    each follows the reply in a frame, its `NodeEntry` in MessagePack (Rule 3)."""
    nodes: list[bytes] = []
    """Those frames, in `changed` order: empty on the wire, the receiving side puts here
    what followed the reply."""
    to_push: list[str]
    """The Nodes whose own config differs from the base's, sorted."""


class Prepared(msgspec.Struct, frozen=True, kw_only=True, tag="prepared"):
    """A valid candidate, planned."""

    config_sha256: str
    plan: Plan
    built: Built | None = None
    """With `build` and a plan without errors."""
    parsed_nodes: int = 0
    """Node entries whose YAML was read, not known by their text to the last proof."""
    checked_nodes: int = 0
    """Node entries checked, not taken from the last proof."""


class Invalid(msgspec.Struct, frozen=True, tag="invalid"):
    """The candidate did not load: every error, with its path."""

    errors: list[ConfigError]


class Failed(msgspec.Struct, frozen=True, tag="failed"):
    """The worker could not do what it was asked (a bug, or a request it cannot read)."""

    message: str


Reply = Hello | Prepared | Invalid | Failed


def frame(payload: bytes) -> bytes:
    """`payload` with its header."""
    return len(payload).to_bytes(HEADER_BYTES, "big") + payload
