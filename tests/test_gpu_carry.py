"""benchmarks/gpu_carry.py's trim of the CUDA provider: only the kept architecture's code survives, in place."""

from __future__ import annotations

import struct

import pytest

from benchmarks.gpu_carry import FATBIN_MAGIC, keep_one_arch, section


def fatbin_entry(kind: int, sm: int, payload: bytes) -> bytes:
    header = bytearray(64)
    struct.pack_into("<HHII", header, 0, kind, 0x101, 64, len(payload))
    struct.pack_into("<I", header, 28, sm)
    return bytes(header) + payload


def elf_with_fatbin(entries: list[bytes]) -> bytearray:
    """A minimal ELF64 file: a null section, .nv_fatbin (one container holding ``entries``, after 8 bytes of padding
    the scan must skip) and the section-name table."""
    body = b"".join(entries)
    fatbin = bytes(8) + struct.pack("<IHHQ", FATBIN_MAGIC, 1, 16, len(body)) + body
    names = b"\0.nv_fatbin\0.shstrtab\0"
    fatbin_at, names_at = 64, 64 + len(fatbin)
    shoff = names_at + len(names)
    elf = bytearray(shoff + 3 * 64)
    elf[:4] = b"\x7fELF"
    struct.pack_into("<Q", elf, 0x28, shoff)
    struct.pack_into("<HHH", elf, 0x3A, 64, 3, 2)
    elf[fatbin_at:names_at] = fatbin
    elf[names_at:shoff] = names
    for i, (name, offset, size) in enumerate([(0, 0, 0), (1, fatbin_at, len(fatbin)), (12, names_at, len(names))]):
        struct.pack_into("<IIQQQQ", elf, shoff + i * 64, name, 1, 0, 0, offset, size)
    return elf


def test_other_architectures_are_zeroed_in_place():
    sm80, sm90 = b"\xaa" * 40, b"\xbb" * 24
    elf = elf_with_fatbin([fatbin_entry(2, 80, sm80), fatbin_entry(2, 90, sm90), fatbin_entry(2, 120, b"\xcc" * 8)])
    before = bytes(elf)
    assert section(elf, ".nv_fatbin") == (64, 8 + 16 + 3 * 64 + 72)

    assert keep_one_arch(elf, 90) == {80: 40, 90: 24, 120: 8}
    assert len(elf) == len(before) and sm90 in elf
    assert b"\xaa" not in elf and b"\xcc" not in elf
    changed = [i for i in range(len(elf)) if elf[i] != before[i]]
    assert len(changed) == 48  # the two payloads only: headers, offsets and the section table are untouched


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ([fatbin_entry(2, 80, b"\xaa" * 8)], r"no sm_90 code in the provider \(found \[80\]\)"),
        ([fatbin_entry(1, 90, b"ptx")], "fatbin entry of kind 1 .* for sm_90: expected cubins only"),
    ],
)
def test_a_provider_this_cannot_trim_is_refused(entries, message):
    with pytest.raises(ValueError, match=message):
        keep_one_arch(elf_with_fatbin(entries), 90)
