"""``lm-rescore nbest --shard K/N`` and ``lm-rescore merge``: one rescoring job as N independent runs (a SLURM array,
a Kubernetes indexed Job), and their outputs put back together as exactly what one run writes.

Shard K of N rescores the contiguous range of utterances [⌊(K − 1)·n/N⌋, ⌊K·n/N⌋) of the list's n (sizes differ by
at most one); with document context (``--context``) each cut moves to the nearest document start, so that a shard
reads its documents whole and scores exactly what one run scores. Contiguous rather than round-robin: the merged list is the shards' lists one after the other, each
shard's output is a range of the input that can be read, checked or run again on its own, and neighbouring
utterances (one speaker, one chapter) stay together. Round-robin would balance a list sorted by length better; the
decoders' dumps we read are in utterance-id order, where the shards' work is even. Every shard reads the whole list:
to find its range, and to fingerprint the input.

What ``merge`` needs travels in each shard's report, under ``"shard"``: its place (K, N, its range), the run's
identity (the input's path, size and sha256, N, the options that change the output, the models' fingerprints), the
output it wrote (path relative to the report, format, size, sha256) and per-utterance statistics
(``rescoring.rescore.utterance_stats``), from which the figures are computed again for the whole list: corpus WER
from summed error and word counts, the bootstrap over every utterance, never an average of the shards' rates. The
leakage check's counts add up too, and its worst offenders are the worst of the shards' (each shard keeps its own
worst, numbered in the whole list).

``tune --shard K/N`` computes the LM scores of shard K only, into a score cache whose header also says where the
shard lies and carries the whole list's cache key; ``merge --caches`` joins the N caches into the cache of the whole
list, byte for byte the one an unsharded run writes, and ``tune --cache`` then tunes on it without running a model.
The search itself is not sharded: it reads every utterance's features at once, and takes seconds.

``merge`` refuses a missing or duplicated shard, shards of different runs (naming the first field of the identity
that differs), and an output that is not the one the shard wrote (its size or sha256 differ: truncated, or written
over since). A shard's LM scores are the scores the whole run computes: the neural LM scores a list the same
whichever lists share its batch (measured bitwise on dev_other; the tests compare the merged list with one run's,
byte for byte).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lmserve.core.atomic import atomic_write_lines, atomic_write_text
from lmserve.rescoring.evaluation import lm_terms_report
from lmserve.rescoring.lmscores import FORMAT, FORMAT_VERSION
from lmserve.rescoring.nbest import SUFFIX_FORMATS, NBestList, output_format, read_nbest, write_nbest
from lmserve.rescoring.overlap import Offender, Overlap
from lmserve.rescoring.rescore import report_from_stats

_SHARD = re.compile(r"(\d+)/(\d+)")
_SUMMED = ("references", "reference_words", "short_references", "matched_references", "covered_words", "seconds")


@dataclass(frozen=True)
class Shard:
    index: int  # 1-based
    count: int
    starts: tuple[int, ...] = ()  # where documents start, with --context (at_documents); () cuts anywhere

    @classmethod
    def parse(cls, text: str) -> Shard:
        match = _SHARD.fullmatch(text.strip())
        if not match or not 1 <= int(match[1]) <= int(match[2]):
            raise ValueError(
                f"--shard {text!r}: expected K/N with 1 <= K <= N, e.g. --shard 2/4 for the second of 4 shards "
                "(SLURM arrays: --array=1-N and --shard $SLURM_ARRAY_TASK_ID/N; Kubernetes indexed Jobs: "
                "--shard $((JOB_COMPLETION_INDEX + 1))/N)"
            )
        return cls(int(match[1]), int(match[2]))

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    @property
    def suffix(self) -> str:
        return f"shard-{self.index}-of-{self.count}"

    def bounds(self, n: int) -> tuple[int, int]:
        return self._cut(self.index - 1, n), self._cut(self.index, n)

    def _cut(self, k: int, n: int) -> int:
        """Where shard k + 1 starts: ⌊k·n/N⌋, or with documents the document start nearest to it."""
        target = k * n // self.count
        if not self.starts or k in (0, self.count):
            return target
        return min(self.starts, key=lambda start: (abs(start - target), start))

    def at_documents(self, documents: list[str]) -> Shard:
        """This shard cut at document boundaries (``documents``: each entry's document, ``rescoring.context``), so
        that a shard reads every document whole, from its first utterance, as one run does. Each document's entries
        must be contiguous, and there must be at least one document per shard."""
        starts, seen = [], set()
        for i, doc in enumerate(documents):
            if i and doc == documents[i - 1]:
                continue
            if doc in seen:
                raise ValueError(
                    f"--shard {self} with --context: document {doc[:80]!r} is not contiguous (again at entry {i + 1}); "
                    "a shard reads whole documents: put each document's utterances together, in spoken order"
                )
            seen.add(doc)
            starts.append(i)
        shard = Shard(self.index, self.count, tuple(starts))
        cuts = [shard._cut(k, len(documents)) for k in range(self.count + 1)]
        if any(a >= b for a, b in itertools.pairwise(cuts)):
            raise ValueError(
                f"--shard {self} with --context: {len(starts)} documents cannot make {self.count} shards of whole "
                "documents; use fewer shards"
                + (" or documents by --context id or document" if len(starts) == 1 else "")
            )
        return shard

    def select(self, nbest: NBestList) -> NBestList:
        """This shard's entries (the list keeps its name: reports name the whole list)."""
        if self.count > len(nbest):
            raise ValueError(
                f"--shard {self}: {self.count} shards for the {len(nbest)} entries of {nbest.name}; "
                "expected at most one shard per entry"
            )
        start, stop = self.bounds(len(nbest))
        return NBestList(nbest.entries[start:stop], nbest.name)


def fingerprint(path: str | Path) -> dict:
    """Size and sha256 of a file, or of a folder's files (their names and contents, in name order)."""
    path = Path(path)
    digest, size = hashlib.sha256(), 0
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        if file != path:
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        with file.open("rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
                size += len(block)
    return {"bytes": size, "sha256": digest.hexdigest()}


def _range_record(shard: Shard, whole: NBestList) -> dict:
    """Which shard of how many, and its utterance range in the whole list (a shard report's and a cache's)."""
    start, stop = shard.bounds(len(whole))
    return {"index": shard.index, "count": shard.count, "start": start, "stop": stop, "utterances": len(whole)}


def shard_record(
    shard: Shard, whole: NBestList, identity: dict, out: Path, out_format: str, report: Path, stats
) -> dict:
    """The ``"shard"`` field of a shard's report (module docstring); ``stats``: ``utterance_stats`` rows, or None
    for lists without references."""
    return {
        **_range_record(shard, whole),
        "references": len(whole.entries[0].references),
        "identity": identity,
        "output": {
            "path": os.path.relpath(Path(out).absolute(), Path(report).absolute().parent),
            "format": out_format,
            **fingerprint(out),
        },
        "stats": None if stats is None else np.asarray(stats).tolist(),
    }


def renumbered(overlap: dict, offset: int) -> dict:
    """A shard's leakage check with its offenders numbered among the references of the whole list."""
    offenders = [{**o, "reference": o["reference"] + offset} for o in overlap["offenders"]]
    return {**overlap, "offenders": offenders}


@dataclass
class Merged:
    nbest: NBestList
    report: dict | None  # None when the shards ran without references (--no-metrics)


def merged_format(shards: list[tuple[Path, dict]], out: Path, out_format: str | None = None) -> str:
    """The format of the merged list: ``--out-format``, else the one ``out``'s name says, else the shards'."""
    fmt = out_format or SUFFIX_FORMATS.get(Path(out).suffix) or shards[0][1]["shard"]["output"]["format"]
    return output_format(out, fmt)


def shard_output(path: Path, report: dict) -> Path:
    """The output a shard's report (read from ``path``) names."""
    return path.parent / report["shard"]["output"]["path"]


def merge(shards: list[tuple[Path, dict]], out: Path, fmt: str, offenders: int = 5) -> Merged:
    """Check the outputs of the shards (``read_shards``) and write the merged list to ``out`` in ``fmt``
    (atomically); the merged report is returned for the caller to write."""
    first = shards[0][1]
    options = first["shard"]["identity"]["options"]
    entries = []
    for path, rep in shards:
        record = rep["shard"]
        output = shard_output(path, rep)
        if not output.exists():
            raise FileNotFoundError(f"{path}: field 'shard.output.path': {output}: no such file or folder")
        found = fingerprint(output)
        wanted = {k: record["output"][k] for k in ("bytes", "sha256")}
        if found != wanted:
            raise ValueError(
                f"{output}: {found['bytes']} bytes, sha256 {found['sha256'][:12]}…; shard {record['index']}/"
                f"{record['count']} wrote {wanted['bytes']} bytes, sha256 {wanted['sha256'][:12]}… ({path}): "
                "truncated or written over since; run that shard again"
            )
        shard_list = read_nbest(output, record["output"]["format"], max_words=options["max_words"])
        if len(shard_list) != record["stop"] - record["start"]:
            raise ValueError(f"{output}: {len(shard_list)} entries; shard {record['index']} has {record['stop']}")
        entries += shard_list.entries
    write_nbest(NBestList(entries, first["shard"]["identity"]["list"]["path"]), out, fmt)
    if first["shard"]["stats"] is None:
        return Merged(NBestList(entries), None)
    stats = np.array([row for _, rep in shards for row in rep["shard"]["stats"]], dtype=np.int64)
    figures = report_from_stats(
        first["list"], first["metric"], stats, first["shard"]["references"], first["bootstrap"]["samples"]
    )
    merged = {k: v for k, v in first.items() if k != "shard"}  # the whole run's fields, in their order
    merged.update(figures)
    if "overlap" in first:
        merged["overlap"] = _merged_overlap([rep["overlap"] for _, rep in shards], offenders)
    terms = first["shard"].get("lm_terms")
    if terms is not None:  # what the LM terms changed (``nbest``'s lms_added.on_this_list), from every shard's rows
        rows = np.array([row for _, rep in shards for row in rep["shard"]["lm_terms"]["stats"]], dtype=np.int64)
        samples = first["bootstrap"]["samples"]
        on_list = lm_terms_report(terms["features"], rows, first["metric"], merged["1best"]["signature"], samples)
        merged["lms_added"]["on_this_list"] = on_list
    return Merged(NBestList(entries), merged)


def cache_shard(shard: Shard, whole: NBestList, key: dict) -> dict:
    """The ``shard`` field of a ``tune --shard`` score cache's header (``key``: the whole list's cache key)."""
    return {**_range_record(shard, whole), "key": key}


def merge_caches(caches: list[Path], out: Path) -> int:
    """Join the score caches of ``tune --shard`` runs into the whole list's cache at ``out``; its entries."""
    headers = []
    for path in caches:
        with Path(path).open(encoding="utf-8") as f:
            try:
                header = json.loads(f.readline())
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:1: not a score cache header ({e.msg})") from None
        if header.get("format") != FORMAT or header.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{path}:1: expected a {FORMAT} v{FORMAT_VERSION} header")
        if not isinstance(header.get("shard"), dict):
            raise ValueError(f"{path}:1: no field 'shard': not the score cache of tune --shard K/N")
        headers.append((Path(path), {"shard": header["shard"]}))
    ordered = _checked_shards(headers, "shard.key")
    lines = []
    for path, header in ordered:
        shard = header["shard"]
        rows = Path(path).read_text(encoding="utf-8").splitlines()[1:]
        if len(rows) != shard["stop"] - shard["start"]:
            raise ValueError(
                f"{path}: {len(rows)} entries; shard {shard['index']}/{shard['count']} scored "
                f"{shard['stop'] - shard['start']}: truncated; run that shard again"
            )
        lines += rows
    key = ordered[0][1]["shard"]["key"]
    atomic_write_lines(out, [json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION, "key": key}), *lines])
    return len(lines)


def write_report(path: Path, report: dict) -> None:
    atomic_write_text(path, json.dumps(report, indent=2, default=float) + "\n")


def read_shards(reports: list[Path]) -> list[tuple[Path, dict]]:
    """The shards' reports in shard order, checked: every shard once, all of one run, ranges that tile the list."""
    shards = []
    for path in reports:
        try:
            rep = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a JSON report (line {e.lineno}: {e.msg}); truncated?") from None
        if not isinstance(rep, dict) or not isinstance(rep.get("shard"), dict):
            raise ValueError(
                f"{path}: no field 'shard': not the report of a shard (lm-rescore nbest --shard K/N --report ...)"
            )
        shards.append((Path(path), rep))
    shards = _checked_shards(shards, "shard.identity")
    for path, rep in shards:
        record = rep["shard"]
        stats = record["stats"]
        if stats is not None and len(stats) != record["stop"] - record["start"]:
            raise ValueError(f"{path}: field 'shard.stats': {len(stats)} rows for {record['stop'] - record['start']}")
    return shards


def _checked_shards(shards: list[tuple[Path, dict]], identity: str) -> list[tuple[Path, dict]]:
    """``shards`` (each a file and its record, with the field ``shard``) in shard order, when they are every
    shard of one run once: the same ``identity`` field (a dotted path) and ranges that tile the list."""

    def field(record: dict):
        for name in identity.split("."):
            record = record[name]
        return record

    first_path, first = shards[0]
    count = first["shard"]["count"]
    seen: dict[int, Path] = {}
    for path, rep in shards:
        record = rep["shard"]
        difference = _first_difference(field(first), field(rep), identity)
        if difference or record["count"] != count:
            raise ValueError(
                f"{path}: field '{difference or 'shard.count'}' differs from {first_path}'s: shards of different "
                "runs (every shard must run the same command on the same input, models and options but --shard and "
                "its outputs)"
            )
        if record["index"] in seen:
            raise ValueError(f"shard {record['index']}/{count} given twice: {seen[record['index']]} and {path}")
        seen[record["index"]] = path
    missing = [k for k in range(1, count + 1) if k not in seen]
    if missing:
        raise ValueError(
            f"shard{'s' if len(missing) > 1 else ''} {', '.join(f'{k}/{count}' for k in missing)} missing "
            f"(given: {', '.join(f'{k}/{count}' for k in sorted(seen))})"
        )
    shards = sorted(shards, key=lambda s: s[1]["shard"]["index"])
    stop = 0
    for path, rep in shards:
        record = rep["shard"]
        if record["start"] != stop or record["stop"] < record["start"]:
            raise ValueError(f"{path}: fields 'shard.start'/'shard.stop': not shard {record['index']}/{count}'s range")
        stop = record["stop"]
    if stop != first["shard"]["utterances"]:
        raise ValueError(f"{shards[-1][0]}: field 'shard.stop': {stop}; the list has {first['shard']['utterances']}")
    return shards


def _first_difference(a, b, where: str) -> str | None:
    """The path of the first field where two JSON values differ, None when they are equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in [*a, *(k for k in b if k not in a)]:
            found = _first_difference(a.get(key), b.get(key), f"{where}.{key}")
            if found:
                return found
        return None
    return None if a == b else where


def _merged_overlap(parts: list[dict], offenders: int) -> dict:
    """The shards' leakage checks as the check of the whole list: counts summed, the worst of their offenders
    (as ``overlap.measure`` orders them), the warning of the whole."""
    first = parts[0]
    worst = sorted(
        (o for part in parts for o in part["offenders"]),
        key=lambda o: (-o["covered_words"] / o["words"], -o["windows_found"], o["reference"]),
    )[:offenders]
    overlap = Overlap(
        n=first["n"],
        **{key: sum(part[key] for part in parts) for key in _SUMMED},
        text_files=first["text_files"],
        text_words=first["text_words"],
        text_lines=first["text_lines"],
        offenders=[Offender(**o) for o in worst],
    )
    return {**overlap.to_dict(), "warning": overlap.warning()}
