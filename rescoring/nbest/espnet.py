"""ESPnet's n-best dump (``asr_inference.py --nbest N``): one folder per rank, line i of every file the same utterance.

    raw_hypotheses/{1..N}best_recog/text     <utt-id> <HYPOTHESIS>            (the hypothesis may be empty)
    raw_hypotheses/{1..N}best_recog/score    <utt-id> tensor(<total>)
    raw_hypotheses/{1..N}best_recog/scores   <utt-id> {"decoder": "tensor(<x>)", "ctc": "tensor(<x>)", "lm": "tensor(<x>)"}
    references/ref_wer.trn                   <REFERENCE><TAB>(<speaker>-<utt-id>)

Read from the folder or straight from a ``.tar.gz`` holding it (members are read in memory, nothing is extracted).
Features: ``score`` (the weighted beam-search total) and every key of ``scores`` (``decoder``, ``ctc``, ``lm``:
unweighted natural-log sums over BPE tokens). ``score``, ``scores`` and the references are optional, ``text`` is not.
The writer writes the same layout (values as ``tensor(...)`` with full precision), so a round trip is exact.
"""

from __future__ import annotations

import gzip
import json
import re
import tarfile
from pathlib import Path

from lmserve.core.command import clip
from lmserve.rescoring.nbest.files import attach_references, decode, read_text, write_folder
from lmserve.rescoring.nbest.model import Hypothesis, NBestEntry, NBestList
from lmserve.rescoring.nbest.parsing import NBestFormatError, parse_number, split_key, split_lines

NAME = "espnet"
TRN = "references/ref_wer.trn"
DUMP_FILE = re.compile(
    r"(?P<root>(?:.*/)?)(?P<rel>raw_hypotheses/(?P<rank>\d+)best_recog/(?P<kind>text|score|scores)|references/ref_wer\.trn)"
)
TENSOR = re.compile(r"tensor\((.*)\)")
TRN_LINE = re.compile(r"(?P<text>.*?)\s*\((?P<id>[^()\s]+)\)\s*")


def detect(path: Path) -> bool:
    if path.is_dir():
        return (path / "raw_hypotheses").is_dir()
    if not path.name.endswith((".tar.gz", ".tgz")):
        return False
    try:
        with tarfile.open(path, "r|*") as tar:
            return any(DUMP_FILE.fullmatch(member.name) for member in tar)
    except (tarfile.TarError, OSError):
        return False


def folder_files(path: Path) -> dict[str, Path]:
    """The files of a dump folder that belong to the layout, by their path inside it."""
    files = [*path.glob("raw_hypotheses/*/*"), path / TRN]
    return {
        f.relative_to(path).as_posix(): f
        for f in files
        if f.is_file() and DUMP_FILE.fullmatch(f.relative_to(path).as_posix())
    }


def dump_files(path: Path) -> dict[str, tuple[str, str]]:
    """The dump's files as {path inside the dump: (name for messages, text)}, from a folder or a tarball."""
    if path.is_dir():
        return {rel: (str(file), read_text(file)) for rel, file in folder_files(path).items()}
    found: dict[str, tuple[str, str]] = {}
    root = None
    # streamed: one pass over the archive. gzip's own reader, not tarfile's: tarfile takes a truncated stream for the
    # end of the archive, and a tarball cut short would read as a list of fewer ranks, without error
    with gzip.open(path, "rb") as stream:
        try:
            with tarfile.open(fileobj=stream, mode="r|") as tar:
                for member in tar:
                    match = DUMP_FILE.fullmatch(member.name)
                    if not match or not member.isfile():
                        continue
                    if root is None:
                        root = match["root"]
                    elif match["root"] != root:
                        raise NBestFormatError(path, f"holds dumps under {root!r} and {match['root']!r}; expected one")
                    name = f"{path}[{member.name}]"
                    found[match["rel"]] = (name, decode(tar.extractfile(member).read(), name))
            while stream.read(1 << 20):  # to the end of the gzip stream: EOFError if it was cut short
                pass
        except TypeError as e:  # what tarfile raises on some truncated gzip headers
            raise NBestFormatError(path, f"not a readable .tar.gz ({e})") from None
    return found


def read_column(files: dict[str, tuple[str, str]], rel: str, ids: list[str]) -> tuple[str, list[str]]:
    """(name, the rest of each line) of a per-rank file, after checking that line i is utterance ``ids[i]``."""
    name, text = files[rel]
    lines = split_lines(text)
    if len(lines) != len(ids):
        raise NBestFormatError(
            name, f"has {len(lines)} lines, expected {len(ids)} (one per utterance, as 1best_recog/text)"
        )
    rests = []
    for lineno, (line, expected) in enumerate(zip(lines, ids, strict=True), 1):
        key, rest = split_key(line, name, lineno, "utterance id")
        if key != expected:
            raise NBestFormatError(
                name,
                f"expected {expected!r} (line {lineno} of 1best_recog/text), got {clip(key)}",
                lineno,
                field="1 (utterance id)",
            )
        rests.append(rest)
    return name, rests


def parse_tensor(text: str, name: str, lineno: int, field: str) -> float:
    """ESPnet prints torch scalars as ``tensor(-0.35)``; plain numbers are accepted too."""
    match = TENSOR.fullmatch(text)
    return parse_number(match[1] if match else text, name, lineno, field)


def parse_scores(text: str, name: str, lineno: int) -> dict[str, float]:
    try:
        parts = json.loads(text)
    except json.JSONDecodeError:
        parts = None
    if not isinstance(parts, dict):
        raise NBestFormatError(name, f"expected a JSON object of scores, got {clip(text)}", lineno, field="2 (scores)")
    return {key: parse_tensor(str(value), name, lineno, f"2 (scores), key {key!r}") for key, value in parts.items()}


def read(path: Path, references: list[Path] | None = None) -> NBestList:
    files = dump_files(path)
    ranks = sorted(int(m["rank"]) for rel in files if (m := DUMP_FILE.fullmatch(rel)) and m["kind"] == "text")
    if not ranks or ranks != list(range(1, len(ranks) + 1)):
        raise NBestFormatError(
            path, f"has text files for ranks {ranks}: expected raw_hypotheses/1best_recog .. Nbest_recog"
        )
    name, text = files["raw_hypotheses/1best_recog/text"]
    ids = [split_key(line, name, lineno, "utterance id")[0] for lineno, line in enumerate(split_lines(text), 1)]
    if len(set(ids)) != len(ids):
        lineno = next(i for i, key in enumerate(ids, 1) if key in ids[: i - 1])
        raise NBestFormatError(
            name, f"utterance {clip(ids[lineno - 1])} appears twice", lineno, field="1 (utterance id)"
        )
    entries = [NBestEntry(key, [], origin=f"{name}:{lineno}") for lineno, key in enumerate(ids, 1)]
    for rank in ranks:
        folder = f"raw_hypotheses/{rank}best_recog"
        features: list[dict[str, float]] = [{} for _ in ids]
        if f"{folder}/score" in files:
            name, values = read_column(files, f"{folder}/score", ids)
            for lineno, (value, feats) in enumerate(zip(values, features, strict=True), 1):
                feats["score"] = parse_tensor(value, name, lineno, "2 (score)")
        if f"{folder}/scores" in files:
            name, values = read_column(files, f"{folder}/scores", ids)
            for lineno, (value, feats) in enumerate(zip(values, features, strict=True), 1):
                feats.update(parse_scores(value, name, lineno))
        name, texts = read_column(files, f"{folder}/text", ids)
        for lineno, (entry, hyp_text, feats) in enumerate(zip(entries, texts, features, strict=True), 1):
            entry.hypotheses.append(Hypothesis(hyp_text, feats, rank, f"{name}:{lineno}"))
    if references:
        attach_references(entries, references)
    elif TRN in files:
        match_references(entries, *files[TRN])
    return NBestList(entries, str(path))


def match_references(entries: list[NBestEntry], name: str, text: str) -> None:
    """Find each utterance's line of ``ref_wer.trn``: its id is ``(<utt-id>)`` or ``(<speaker>-<utt-id>)``."""
    by_suffix: dict[str, list[str]] = {}  # every id and every part of one after a '-', for the speaker prefix
    refs = {}
    for lineno, line in enumerate(split_lines(text), 1):
        match = TRN_LINE.fullmatch(line)
        if not match:
            raise NBestFormatError(
                name, f"expected '<reference> (<speaker>-<utt-id>)', got {clip(line)}", lineno, field="2 (utterance id)"
            )
        trn_id = match["id"]
        refs[trn_id] = match["text"].strip()
        for cut in [-1] + [i for i, c in enumerate(trn_id) if c == "-"]:
            by_suffix.setdefault(trn_id[cut + 1 :], []).append(trn_id)
    for entry in entries:
        found = [entry.id] if entry.id in refs else by_suffix.get(entry.id, [])
        if len(found) != 1:
            problem = "no line" if not found else f"{len(found)} lines ({', '.join(found[:3])})"
            raise NBestFormatError(
                name,
                f"{problem} for utterance {clip(entry.id)}: expected one ending in '({entry.id})' or '(<speaker>-{entry.id})'",
            )
        entry.references = [refs[found[0]]]


def write(nbest: NBestList, path: Path) -> None:
    """Write the layout into the folder ``path``; layout files of an earlier dump there that this one lacks
    (more ranks, a ``scores`` file) are removed, so that reading it back gives this list and nothing else."""
    sizes = {len(entry.hypotheses) for entry in nbest}
    if len(sizes) > 1:
        raise ValueError(
            f"{path}: the ESPnet layout needs the same number of hypotheses per utterance, got {sorted(sizes)}"
        )
    earlier = list(folder_files(path)) if path.is_dir() else []
    contents = {}
    for rank in range(1, max(sizes, default=0) + 1):
        hyps = [(entry.id, entry.hypotheses[rank - 1]) for entry in nbest]
        folder = f"raw_hypotheses/{rank}best_recog"
        contents[f"{folder}/text"] = "".join(f"{key} {hyp.text}\n" for key, hyp in hyps)
        if any("score" in hyp.features for _, hyp in hyps):
            missing = [key for key, hyp in hyps if "score" not in hyp.features]
            if missing:
                raise ValueError(f"{path}: rank {rank} of {missing[0]!r} has no 'score' feature, other hypotheses do")
            contents[f"{folder}/score"] = "".join(f"{key} tensor({hyp.features['score']!r})\n" for key, hyp in hyps)
        if any(set(hyp.features) - {"score"} for _, hyp in hyps):
            contents[f"{folder}/scores"] = "".join(
                f"{key} " + json.dumps({k: f"tensor({v!r})" for k, v in hyp.features.items() if k != "score"}) + "\n"
                for key, hyp in hyps
            )
    if any(entry.references for entry in nbest):
        counts = [(entry.id, len(entry.references)) for entry in nbest if len(entry.references) != 1]
        if counts:
            raise ValueError(
                f"{path}: ref_wer.trn holds one reference per utterance, {counts[0][0]!r} has {counts[0][1]}"
            )
        contents[TRN] = "".join(f"{entry.references[0]}\t({entry.id}-{entry.id})\n" for entry in nbest)
    write_folder(path, contents, earlier)
