"""Whether `edge.state_dir` can hold the ledger (`runtime.metering.state_dir`): the reason a
check gives is the real one."""

from __future__ import annotations

from pathlib import Path

import pytest

from iop_edge.runtime.metering import state_dir


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="no /proc on this system")
def test_a_folder_on_a_filesystem_that_stores_no_files_is_not_called_a_full_disk() -> None:
    with pytest.raises(state_dir.StateDirUnusable) as refused:
        state_dir.inspect(Path("/proc/iop-state"))
    message = str(refused.value)
    assert "stores no files" in message and "full" not in message


def test_a_folder_on_a_disk_with_room_is_fine(tmp_path: Path) -> None:
    state_dir.inspect(tmp_path / "state")
