"""The admin credential's file and its check (`iop_edge.runtime.lifecycle.admin_credential`)."""

from __future__ import annotations

import os
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from iop_edge.runtime.lifecycle.admin_credential import (
    ADMIN_TOKEN_FILE,
    AdminCredentialUnusable,
    load_or_create,
    matches,
    read,
)


def test_made_once_private_then_read(tmp_path: Path) -> None:
    token = load_or_create(tmp_path)
    path = tmp_path / ADMIN_TOKEN_FILE
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert len(token) >= 32 and load_or_create(tmp_path) == token == read(path)
    assert [p.name for p in tmp_path.iterdir()] == [ADMIN_TOKEN_FILE]  # no draft left


def test_edges_starting_together_agree(tmp_path: Path) -> None:
    with ThreadPoolExecutor(8) as pool:
        tokens = set(pool.map(lambda _: load_or_create(tmp_path), range(32)))
    assert len(tokens) == 1


@pytest.mark.parametrize("content", [b"", b"\n", b"two words\n", b"x" * 300])
def test_a_file_that_holds_no_credential_is_named(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / ADMIN_TOKEN_FILE
    path.write_bytes(content)
    with pytest.raises(AdminCredentialUnusable, match="does not hold an admin credential"):
        load_or_create(tmp_path)


def test_an_unreadable_place_is_named(tmp_path: Path) -> None:
    with pytest.raises(AdminCredentialUnusable, match="cannot create"):
        load_or_create(tmp_path / "missing" / "folder")
    with pytest.raises(AdminCredentialUnusable, match="cannot read"):
        read(tmp_path / "none")


def test_only_the_bearer_token_matches() -> None:
    assert matches("Bearer s3cret", "s3cret") and matches("bearer  s3cret ", "s3cret")
    for header in (None, "", "Bearer", "Bearer other", "Basic s3cret", "s3cret"):
        assert not matches(header, "s3cret")
    assert not matches("Bearer ", "")  # no credential matches nothing
