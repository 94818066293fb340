"""The config schema as documentation: every key's path, and a JSON Schema for editors.

The reference in `docs/configuration.md` is written by hand (a key deserves a sentence,
not a type dump), so it can drift from the Structs in `schemas.config`. This module lists
what the schema really has, and a test holds the two together: a key the schema has and
the reference lacks, or a key the reference names that no longer exists, fails the suite.
The JSON Schema (`iop-edge config-schema`) is generated straight from the Structs, so an
editor that validates YAML against it checks exactly what `check-config` checks by type.

Rules:
1. A key path reads like the config: `nodes[].providers[].adapter.base_url`; a list of
   Structs is `[]`, a mapping of free-form keys (`models[].providers`) ends the path.
2. Paths are listed in the order the schema declares them, each once.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import inspect

from schemas.config import EdgeConfig

__all__ = ["config_key_paths", "json_schema"]


def json_schema() -> dict[str, Any]:
    """The Edge config's JSON Schema (draft 2020-12), titled for editors."""
    schema = msgspec.json.schema(EdgeConfig)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "IOP Edge configuration",
        **schema,
    }


def config_key_paths() -> list[str]:
    """Every key path of the Edge config (Rules 1-2)."""
    paths: list[str] = []
    _walk(inspect.type_info(EdgeConfig), "", paths)
    return paths


def _walk(info: inspect.Type, prefix: str, paths: list[str]) -> None:
    struct = _struct_of(info)
    if struct is None:
        return
    for field in struct.fields:
        path = f"{prefix}{field.encode_name}"
        paths.append(path)
        inner = field.type
        if isinstance(inner, inspect.UnionType):
            inner = next((t for t in inner.types if not isinstance(t, inspect.NoneType)), inner)
        if isinstance(inner, inspect.ListType) and _struct_of(inner.item_type) is not None:
            _walk(inner.item_type, f"{path}[].", paths)
        elif _struct_of(inner) is not None:
            _walk(inner, f"{path}.", paths)


def _struct_of(info: inspect.Type) -> inspect.StructType | None:
    if isinstance(info, inspect.StructType):
        return info
    if isinstance(info, inspect.UnionType):
        structs = [t for t in info.types if isinstance(t, inspect.StructType)]
        if len(structs) == 1:
            return structs[0]
    return None
