"""What a valid config already proved about its node entries, so the next one re-checks
only the entries that changed.

A refresh of a fleet's config usually changes a few Nodes of thousands. Most of the
checks on a node entry depend on that entry alone: its shape against `NodeEntry`, its
providers' adapter settings and slot counts, the demo-token rule (which also reads
whether `edge.listen` is a loopback address), and the Structs built from it. Those
results are kept per entry, keyed by the entry's raw data, and reused while the raw
data is the same.

Rules:
1. An entry is the same when its raw data pickles to the same bytes: type for type
   (`1`, `1.0` and `true` differ, unlike with `==`) and key order for key order. Equal
   data may pickle differently (shared strings); such an entry is merely checked again.
2. A proof holds for configs whose `edge.listen` is as loopback as the proving one's.
3. What spans entries is never taken from a proof: unique node and provider ids, the
   models' references to providers, the legacy routes. Those checks run on every config.
4. A proof is the last valid config's, whole: the entries of a config before it are
   not kept, so a proof costs one key, one Struct and one entry's text per Node of the
   running fleet.
5. An entry is also known by its text (`core.configuration.config_pieces`), when the parse confirmed
   where the proving config's entries are: a candidate's entry with the very same text
   is the same raw data, so it needs no parse either. The text gives the key; Rule 2
   still decides whether the entry holds.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field

from iop_edge.core.configuration.config_pieces import ConfigPieces
from schemas.config import NodeEntry

__all__ = ["ConfigProof", "entry_key"]


def entry_key(raw_entry: object) -> bytes:
    """The identity of one raw node entry (Rule 1)."""
    return pickle.dumps(raw_entry, protocol=pickle.HIGHEST_PROTOCOL)


@dataclass(frozen=True, slots=True)
class ConfigProof:
    """The node entries a valid config proved, by `entry_key` of their raw data."""

    edge_loopback: bool
    """Whether `edge.listen` was a loopback address (Rule 2)."""
    entries: Mapping[bytes, NodeEntry] = field(default_factory=dict)
    """Each entry's Structs, as the config that proved it built them."""
    texts: Mapping[str, bytes] = field(default_factory=dict)
    """Each entry's key by the entry's text (Rule 5); empty when the proving config's
    entries could not be told apart in its text."""

    def entry(self, key: bytes, *, edge_loopback: bool) -> NodeEntry | None:
        """The proven entry for raw data `key`, or None when it must be checked."""
        if edge_loopback != self.edge_loopback:
            return None
        return self.entries.get(key)

    def known(self, pieces: ConfigPieces) -> dict[int, bytes]:
        """The entries of `pieces` this proof knows by their text (Rule 5): their keys,
        by index in `nodes`."""
        texts, entries = self.texts, self.entries
        known: dict[int, bytes] = {}
        if texts:
            for index in range(pieces.entries):
                key = texts.get(pieces.entry(index))
                if key is not None and key in entries:
                    known[index] = key
        return known
