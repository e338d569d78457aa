"""What a lent GPU machine lacks for the GPU scorer, packed into .gpu/ in pieces that fit its 64 MiB carries.

    python -m benchmarks.gpu_carry --python312 ~/.pyenv/versions/3.12.1/bin/python

The lent H100/H200 machines run Python 3.12 with torch and the CPU onnxruntime, reach no package index, and take at
most 64 MiB of working tree a call (/work/.library/device/README.md). onnxruntime-gpu's wheel is 255 MB, nearly all
of it the CUDA provider library, whose ``.nv_fatbin`` section holds each kernel compiled for six GPU architectures
(sm_75 to sm_120, no PTX). A Hopper GPU runs only the sm_90 code, so the others are zeroed in place (the library keeps
its layout, offsets and symbols; the loader picks the sm_90 entry and never reads the rest) and xz packs the zeros to
nothing: 284 MB -> 52 MB. It is one carry; the rest of onnxruntime, the wheels the machine lacks (jiwer, kenlm built
with ``--python312``, gRPC's health and reflection, grpcio and protobuf as new as lmserve's generated code needs) go
in another, with the bundle and lists benchmarks/gpu_scorer.sh measures.

A call's tree replaces what an earlier call carried, warm machine or not, so the first call copies its carry out of
the tree and the second copies it back. A machine goes back 30 s after a call ends: make the second call at once. The
first call also runs the training step's benchmark, which needs no carry (a lease is 15 minutes, the machine's start
included: timeout_s about 360 and 420). The machine's git history is stale, so name the commit: C below is
``git rev-parse --short HEAD`` here.

    carry .gpu/prov .gpu/whlA .gpu/lists:  mkdir -p /tmp/keep && cp -r .gpu/prov .gpu/whlA .gpu/lists /tmp/keep/ &&
                                           LMSERVE_COMMIT=C TEST_SECONDS=60 OUT=$OUT bash benchmarks/gpu_step.sh
    carry .gpu/ort .gpu/whl .gpu/bundle:   cp -r /tmp/keep/* .gpu/ && LMSERVE_COMMIT=C OUT=$OUT \
                                           bash benchmarks/gpu_scorer.sh

Layout written (each a separate ``carry`` path): ``.gpu/prov`` (the provider, xz), ``.gpu/ort`` (the rest of the
onnxruntime-gpu wheel, tar.xz), ``.gpu/whl`` and ``.gpu/whlA`` (wheels, split to balance the two carries). The bundle
and lists are made apart: ``.gpu/bundle`` an ``lm-train export --weights int8`` (30 MiB for the English LM's shapes;
configs/gpu_carry_bundle.toml says how it is trained), ``.gpu/lists/dev_other500.jsonl.gz`` the first 500 dev_other
lists written by ``write_nbest(..., "jsonl")``.
"""

from __future__ import annotations

import argparse
import io
import lzma
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from benchmarks.common import ROOT

PLATFORM = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
WHEELS = {  # the lent machine's image lacks these (KINDS.md's package list); grpcio/protobuf: lmserve/v1's gencode
    "whl": ["grpcio==1.85.1", "protobuf>=7.35.1", "grpcio-health-checking==1.85.1", "grpcio-reflection==1.85.1"],
    "whlA": ["jiwer", "rapidfuzz"],
}
PROVIDER = "onnxruntime/capi/libonnxruntime_providers_cuda.so"
FATBIN_MAGIC = 0xBA55ED50


def section(elf: bytes, name: str) -> tuple[int, int]:
    """(file offset, size) of an ELF64 little-endian section."""
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    for sh_name, _type, _flags, _addr, offset, size in headers:
        end = elf.index(b"\0", names_at + sh_name)
        if elf[names_at + sh_name : end].decode() == name:
            return offset, size
    raise ValueError(f"no section {name!r}")


def keep_one_arch(elf: bytearray, sm: int) -> dict[int, int]:
    """Zero every fatbin entry's payload not compiled for ``sm`` (e.g. 90); returns bytes per architecture found.
    Fails if no entry is for ``sm`` or one holds PTX (a JIT fallback this would break)."""
    offset, size = section(elf, ".nv_fatbin")
    pos, end, found = offset, offset + size, {}
    while pos < end:
        magic, _version, header, fat_size = struct.unpack_from("<IHHQ", elf, pos)
        if magic != FATBIN_MAGIC:  # containers are 8-byte aligned, with padding between them
            pos += 8
            continue
        entry, entries_end = pos + header, pos + header + fat_size
        while entry < entries_end:
            kind, _v, entry_header, padded = struct.unpack_from("<HHII", elf, entry)
            arch = struct.unpack_from("<I", elf, entry + 28)[0]
            if kind != 2:
                raise ValueError(f"fatbin entry of kind {kind} (PTX?) for sm_{arch}: expected cubins only")
            found[arch] = found.get(arch, 0) + padded
            if arch != sm:
                elf[entry + entry_header : entry + entry_header + padded] = bytes(padded)
            entry += entry_header + padded
        pos = entries_end
    if sm not in found:
        raise ValueError(f"no sm_{sm} code in the provider (found {sorted(found)})")
    return found


def download(specs: list[str], dest: Path) -> None:
    platforms = [arg for p in PLATFORM for arg in ("--platform", p)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
         "--implementation", "cp", *platforms, "-d", str(dest), *specs],
        check=True,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / ".gpu")
    parser.add_argument("--onnxruntime", default="onnxruntime-gpu==1.31.1", help="built for CUDA 13, as torch there")
    parser.add_argument("--sm", type=int, default=90, help="the GPU's architecture: 90 for the H100 and H200")
    parser.add_argument("--python312", help="a Python 3.12 to build the kenlm wheel with (its PyPI source only)")
    args = parser.parse_args()
    for part in ("prov", "ort", "whl", "whlA"):
        shutil.rmtree(args.out / part, ignore_errors=True)
        (args.out / part).mkdir(parents=True)
    for part, specs in WHEELS.items():
        download(specs, args.out / part)
    if args.python312:
        subprocess.run([args.python312, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(args.out / "whlA"), "kenlm"],
                       check=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        download([args.onnxruntime], Path(tmp))
        wheel = zipfile.ZipFile(next(Path(tmp).glob("*.whl")))
        elf = bytearray(wheel.read(PROVIDER))
        print("fatbin bytes per sm:", keep_one_arch(elf, args.sm))
        (args.out / "prov" / "libonnxruntime_providers_cuda.so.xz").write_bytes(lzma.compress(bytes(elf)))
        with tarfile.open(args.out / "ort" / "onnxruntime.tar.xz", "w:xz") as tar:
            for info in wheel.infolist():
                if info.filename == PROVIDER or "providers_tensorrt" in info.filename or info.is_dir():
                    continue
                member = tarfile.TarInfo(info.filename)
                member.size = info.file_size
                tar.addfile(member, io.BytesIO(wheel.read(info)))
    for part in sorted(args.out.iterdir()):
        print(f"{part}: {sum(f.stat().st_size for f in part.rglob('*') if f.is_file()) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
