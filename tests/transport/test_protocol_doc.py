"""Keep docs/protocol.md honest: its tables and worked example must match the code."""

import dataclasses
import re
import struct
from pathlib import Path

import pytest
import torch

from splitlm.cloud.sessions import ServerLimits
from splitlm.transport.errors import ErrorCode
from splitlm.transport.frames import (
    HEADER,
    HEADER_SIZE,
    VERSION,
    Frame,
    MsgType,
    decode_frame,
    encode_frame,
    pack_mask,
)

DOC = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()


def section(heading: str) -> str:
    """The text from a heading line that starts with `heading` up to the next heading of any level."""
    m = re.search(rf"^#+ {re.escape(heading)}.*?$(.*?)(?=^#+ |\Z)", DOC, re.M | re.S)
    assert m, f"no section {heading!r} in docs/protocol.md"
    return m.group(1)


def table_rows(text: str) -> list[list[str]]:
    """Cells of the body rows of every markdown table in `text` (each table's first row and rule dropped)."""
    rows, prev_table = [], False
    for line in text.splitlines():
        if not line.startswith("|"):
            prev_table = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if prev_table and not set("".join(cells)) <= set("-: "):
            rows.append(cells)
        prev_table = True
    return rows


def first_code_block(text: str) -> str:
    m = re.search(r"```[a-z]*\n(.*?)```", text, re.S)
    assert m
    return m.group(1).strip()


def test_header_table_matches_the_struct():
    rows = table_rows(section("Header"))
    offsets, sizes = [int(r[0]) for r in rows], [int(r[1]) for r in rows]
    assert sum(sizes) == HEADER_SIZE == 32
    assert offsets == [sum(sizes[:i]) for i in range(len(sizes))]
    fields = re.findall(r"\d*[a-zA-Z]", HEADER.format.lstrip("!"))
    assert sizes == [struct.calcsize("!" + f) for f in fields]
    assert f"`{HEADER.format}`" in DOC


@pytest.mark.parametrize("enum", [MsgType, ErrorCode])
def test_every_name_has_a_table_row_with_its_value(enum):
    rows = table_rows(DOC)
    for member in enum:
        assert any(f"`{member.name}`" in r and str(int(member)) in r for r in rows), member


def test_limits_table_matches_the_defaults():
    rows = {r[0].strip("`"): r[1] for r in table_rows(section("8. Sessions and limits"))}
    for f in dataclasses.fields(ServerLimits):
        assert float(rows[f.name]) == f.default, f.name


def test_mask_example_is_what_pack_mask_writes():
    m = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    assert f"mask = {pack_mask(m).hex(' ')}" in section("6. FORWARD semantics")


def test_worked_example_decodes_to_the_documented_values():
    text = section("10. Worked example")
    data = bytes.fromhex(first_code_block(text))
    frame = decode_frame(data)
    fingerprint = re.search(r'"fingerprint": "([0-9a-f]{32})"', text).group(1)
    assert (frame.type, frame.session, frame.seq, frame.flags, frame.payload) == (MsgType.HELLO, 0, 1, 0, b"")
    assert set(frame.meta) == {"version", "fingerprint", "e", "s"}
    assert (frame.meta["version"], frame.meta["fingerprint"]) == (VERSION, fingerprint)
    assert all(isinstance(frame.meta[k], bytes) and len(frame.meta[k]) == 32 for k in "es")
    assert encode_frame(Frame(MsgType.HELLO, seq=1, meta=frame.meta)) == data
    assert f"({len(data)} bytes)" in text
    # the annotated rows spell out the whole frame, each at its offset
    offset = 0
    for row in table_rows(text):
        assert int(row[0]) == offset, row
        chunk = bytes.fromhex(row[1].strip("`"))
        assert data[offset : offset + len(chunk)] == chunk, row
        offset += len(chunk)
    assert offset == len(data)
