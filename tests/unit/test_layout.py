"""The tree stays readable: rooms, not piles (design §19).

A folder holds at most 15 modules and a module at most 800 lines, so a reader finds a
concept by its room and reads a module in one sitting. A folder that grows past the bound
splits into rooms named after what they own; a module that grows past it splits along
its concepts."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("schemas", "iop_edge", "iop_node")
MAX_MODULES = 15
MAX_LINES = 800


def _folders() -> list[Path]:
    return [
        folder
        for package in PACKAGES
        for folder in [ROOT / package, *(ROOT / package).rglob("*")]
        if folder.is_dir() and (folder / "__init__.py").is_file()
    ]


def test_no_folder_holds_more_than_fifteen_modules() -> None:
    crowded = {
        str(folder.relative_to(ROOT)): count
        for folder in _folders()
        if (count := sum(1 for m in folder.glob("*.py") if m.name != "__init__.py")) > MAX_MODULES
    }
    assert not crowded, f"folders over {MAX_MODULES} modules (split them into rooms): {crowded}"


def test_no_module_is_longer_than_eight_hundred_lines() -> None:
    long = {
        str(module.relative_to(ROOT)): lines
        for folder in _folders()
        for module in folder.glob("*.py")
        if (lines := len(module.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by concept): {long}"


def test_the_walk_sees_the_packages() -> None:
    """The bounds are checked on the real tree, not on an empty walk."""
    folders = {str(f.relative_to(ROOT)) for f in _folders()}
    assert {"iop_edge/core/routing", "iop_node/uplink", "schemas/runtime"} <= folders
