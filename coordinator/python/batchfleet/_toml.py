"""A manifest given as a dict, written as TOML (the standard library reads
TOML but does not write it)."""

from __future__ import annotations

import json
import math
from typing import Any, Dict, List


def dumps(doc: Dict[str, Any]) -> str:
    """``doc`` as a TOML document: nested dicts become ``[tables]``, lists
    of dicts ``[[arrays of tables]]``, everything else ``key = value``."""
    lines: List[str] = []
    _table(doc, [], lines)
    return "\n".join(lines).lstrip("\n") + "\n"


def _key(k: str) -> str:
    if k and all(c.isalnum() or c in "-_" for c in k):
        return k
    return json.dumps(k)


def _is_table(v: Any) -> bool:
    return isinstance(v, dict)


def _is_table_array(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def _table(doc: Dict[str, Any], path: List[str], lines: List[str]) -> None:
    for k, v in doc.items():
        if not isinstance(k, str):
            raise TypeError(f"manifest keys are strings, not {k!r}")
        if v is None or _is_table(v) or _is_table_array(v):
            continue
        lines.append(f"{_key(k)} = {_value(v, path + [k])}")
    for k, v in doc.items():
        if _is_table(v):
            lines.append("")
            lines.append("[" + ".".join(_key(p) for p in path + [k]) + "]")
            _table(v, path + [k], lines)
        elif _is_table_array(v):
            for entry in v:
                lines.append("")
                lines.append("[[" + ".".join(_key(p) for p in path + [k]) + "]]")
                _table(entry, path + [k], lines)


def _value(v: Any, where: List[str]) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if hasattr(v, "__fspath__"):
        return json.dumps(str(v.__fspath__()), ensure_ascii=False)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x, where) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_value(x, where + [k])}" for k, x in v.items()) + " }"
    raise TypeError(f"{'.'.join(where)}: a manifest holds strings, numbers, booleans, lists and tables, not {type(v).__name__}")
