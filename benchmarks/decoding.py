"""What the decoding benchmarks share (decode_synthetic, beam_step_load, state_cache_soak): the English LM (a word
bundle, its 4-gram on the same vocabulary, LibriSpeech text form), LibriSpeech dev references, a server config for
it, and the server's CPU time and memory read from /proc.

The model: the shipped ``models/english_lm`` (``--bundle``), ``var/ngrams/english_lm_4gram.bin`` (``--ngram``, made by
``make ngram-english_lm``), text normaliser
preset ``librispeech`` (upper case, punctuation stripped: LibriSpeech's own form), interpolation λ = 0.5 unless a
benchmark says otherwise. Tests run the same code on the tiny bundles of tests/conftest.py.
"""

from __future__ import annotations

import os
import string
from pathlib import Path

import numpy as np

from benchmarks.common import DATA_DIR, ROOT
from lmserve.core.bundle import Bundle
from lmserve.core.textnorm import PRESETS, TextNormalizer
from lmserve.rescoring.nbest import read_nbest

BUNDLE = ROOT / "models" / "english_lm"
NGRAM = ROOT / "var" / "ngrams" / "english_lm_4gram.bin"
NORMALIZE = "librispeech"
LAMBDA = 0.5
LABELS = ["", " ", "'", *string.ascii_uppercase]  # CTC labels: blank, word separator, LibriSpeech's characters
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def add_model_arguments(parser) -> None:
    """``--bundle``, ``--ngram``, ``--lam`` and ``--normalize``: the model every decoding benchmark runs."""
    parser.add_argument("--bundle", type=Path, default=BUNDLE)
    parser.add_argument("--ngram", type=Path, default=NGRAM, help="interpolated with the bundle at --lam")
    parser.add_argument("--lam", type=float, default=LAMBDA)
    parser.add_argument("--normalize", default=NORMALIZE, help="textnorm preset ('' for the bundle's own)")


def references(split: str, limit: int | None = None, seed: int = 0) -> list[str]:
    """LibriSpeech ``split`` references (``librispeech-nbest/SPLIT.tar.gz``), in a fixed shuffled order."""
    nbest = read_nbest(DATA_DIR / "librispeech-nbest" / f"{split}.tar.gz")
    texts = [" ".join(e.references[0].split()) for e in nbest.entries if e.references]
    order = np.random.default_rng(seed).permutation(len(texts))
    return [texts[i] for i in order[:limit]]


def walk_inputs(args) -> tuple[str | None, list[str], list[str], Path | None]:
    """What the step benchmarks walk: the normalisation preset (None: the bundle's own), the sentences in the LM's
    form (``--texts``, else 500 dev_other references; with the bundle's own normalisation, as the server reads them),
    the bundle's words, and the n-gram when it exists."""
    normalize = args.normalize or None
    texts = args.texts.read_text().splitlines() if args.texts else references("dev_other", 500)
    bundle = Bundle.load(args.bundle)
    view = PRESETS[normalize] if normalize else TextNormalizer.from_dict(bundle.manifest["text"])  # as the server's
    vocab = [t for t in bundle.tokens if not t.startswith("<")]
    ngram = args.ngram if args.ngram and args.ngram.exists() else None
    return normalize, [view.normalize(t) for t in texts], vocab, ngram


def serve_config(
    folder: Path,
    bundle: Path,
    ngram: Path | None,
    lam: float | None,
    normalize: str | None = NORMALIZE,
    workers: int = 2,
    state_cache_mb: float = 256.0,
    ttl_seconds: float = 60.0,
    max_wait_ms: float = 2.0,
    model: str = "english",
    device: str = "cpu",
) -> Path:
    """A one-model lm-serve config. ``max_wait_ms`` is short: beam steps are latency-bound (a step merges with the
    steps of other decoders that are already waiting, not with those a longer wait would bring). ``device``: where
    the neural LM runs (``server.device``)."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [
        f"[server]\nworkers = {workers}\nscorer_threads = 1\nmetrics_port = 0\nmax_concurrent_calls = 1024\n",
        f'device = "{device}"\n',
        f"grace_seconds = 30.0\nadmin = true\n[batching]\nmax_wait_ms = {max_wait_ms}\n",
        f"[limits]\nmax_message_bytes = {64 << 20}\n",
        f"[state_cache]\nmax_mb = {state_cache_mb}\nttl_seconds = {ttl_seconds}\n",
        f'[models.{model}]\nbundle = "{bundle}"\n',
    ]
    if normalize:
        lines.append(f'normalize = "{normalize}"\n')
    if ngram:
        lines.append(f'ngram = "{ngram}"\n')
        if lam:
            lines.append(f"lambda = {lam}\n")
    path = folder / "serve.toml"
    path.write_text("".join(lines))
    return path


def _tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def cpu_seconds(root: int) -> float:
    """User + system CPU seconds of process ``root`` and its living descendants (scoring processes included)."""
    total = 0
    for pid in _tree(root):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / CLOCK_TICKS


def rss_mb(root: int) -> float:
    """Resident memory of process ``root`` and its descendants, MB."""
    total = 0
    for pid in _tree(root):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def percentiles(values_ms: list[float]) -> dict:
    a = np.asarray(values_ms, dtype=np.float64)
    if not len(a):
        return {"n": 0}
    return {
        "n": len(a),
        "p50_ms": float(np.percentile(a, 50)),
        "p99_ms": float(np.percentile(a, 99)),
        "mean_ms": float(a.mean()),
        "max_ms": float(a.max()),
    }
