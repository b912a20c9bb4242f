"""raw_kernels/gs_layout.cuh and graphstash/_layout.py describe the same device tensors: every
``#define GS_<NAME> <int>`` of the header is ``<NAME> = <int>`` in the module and back."""
from __future__ import annotations

import re

import pytest

from graphstash import _layout
from raw_kernels import source_path

_DEFINE = re.compile(r"^\s*#define\s+GS_([A-Z0-9_]+)\s+(-?\d+)\b", re.MULTILINE)


def header_constants(text: str) -> dict[str, int]:
    """``{NAME: value}`` of the ``#define GS_NAME value`` lines of a header's text."""
    found: dict[str, int] = {}
    for name, value in _DEFINE.findall(text):
        assert name not in found, f"GS_{name} is defined twice"
        found[name] = int(value)
    return found


def module_constants(module) -> dict[str, int]:
    """``{NAME: value}`` of the upper-case int constants of a module."""
    return {k: v for k, v in vars(module).items()
            if k.isupper() and isinstance(v, int) and not isinstance(v, bool)}


def disagreements(header: dict[str, int], module: dict[str, int]) -> list[str]:
    """What differs between the two sets of constants, one line per name (empty: they agree)."""
    lines = []
    for name in sorted(header.keys() | module.keys()):
        if name not in module:
            lines.append(f"GS_{name} = {header[name]} in the header, missing in _layout.py")
        elif name not in header:
            lines.append(f"{name} = {module[name]} in _layout.py, missing in the header")
        elif header[name] != module[name]:
            lines.append(f"{name}: {header[name]} in the header, {module[name]} in _layout.py")
    return lines


def _header_text() -> str:
    return source_path("gs_layout.cuh").read_text()


def test_header_and_module_agree():
    header = header_constants(_header_text())
    assert len(header) >= 20                    # the parser found the layout, not nothing
    assert disagreements(header, module_constants(_layout)) == []


@pytest.mark.parametrize("edit", ["change", "drop", "add"])
def test_a_disagreement_is_reported(edit):
    """The comparison the test above relies on does fail when the files disagree."""
    text = _header_text()
    if edit == "change":
        text = text.replace("#define GS_SS_HOST_SPILL 1", "#define GS_SS_HOST_SPILL 5")
        expected = "SS_HOST_SPILL: 5 in the header, 1 in _layout.py"
    elif edit == "drop":
        text = text.replace("#define GS_ST_DEMAND_PEAK 7", "")
        expected = "ST_DEMAND_PEAK = 7 in _layout.py, missing in the header"
    else:
        text += "\n#define GS_ST_NEW_FIELD 13\n"
        expected = "GS_ST_NEW_FIELD = 13 in the header, missing in _layout.py"
    assert text != _header_text()
    assert disagreements(header_constants(text), module_constants(_layout)) == [expected]
