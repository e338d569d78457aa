"""The model bundle: the one contract between training (``lm-train export`` writes it, with the names and versions
defined here) and serving (this module reads and validates it). Format versions 2 (word vocabularies) and 3 (open vocabularies: the same plus a
sentencepiece model), documented here once; version 1 bundles are still read.

A bundle is a directory::

    manifest.json      what the model is and how to use it (below)
    vocab.tsv          "#lmserve-vocab v1", then "token<TAB>count" per id; ids 0, 1, 2 are <unk>, <s>, </s>
    sentences.onnx     whole sentences -> per-token scores
    step.onnx          one step for decoders -> scores of K candidate next words
    step_full.onnx     one step for decoders -> scores of the whole vocabulary
    subword.model      version 3 only: the sentencepiece model whose pieces vocab.tsv lists
    sentences_open.onnx  optional (heads that spell: charcnn, cnnsoftmax): whole sentences whose unknown words are
                       scored from their spelling
    weights.bin        optional (with ``weights``): the graphs' large initializers, once each, as ONNX external
                       data that every graph points into

Graphs (float32 scores in natural log; dynamic batch B, length T, candidates K; L layers, state size H):

- ``sentences``: ``input_ids`` int64 [B, T] (``<s> w1 .. wn`` padded with any id), ``target_ids`` int64 [B, T]
  (``w1 .. wn </s>`` padded), ``lengths`` int64 [B] (n + 1), ``h0``, ``c0`` float32 [L, B, H] -> ``logprobs``
  [B, T], 0 at padded positions. A sentence starts from a zero state: sentences are scored independently. A
  non-zero ``h0``/``c0`` continues a prefix read elsewhere (the ``step`` graph's ``h_out``/``c_out``): the scorer
  runs the tails of n-best hypotheses this way from the point where they leave the shared prefix tree.
  (Version 1: no ``h0``/``c0`` inputs, always a zero state; the only difference between the versions.)
- ``step``: ``prev_ids`` int64 [B], ``h``, ``c`` float32 [L, B, H], ``candidates`` int64 [B, K] -> ``logprobs``
  [B, K], ``h_out``, ``c_out`` [L, B, H]. The state goes in *before* ``prev_ids`` is read and comes out after it;
  the scores are for the word that follows ``prev_ids``. A sentence starts with a zero state and ``prev_ids = <s>``.
- ``step_full``: as ``step`` without ``candidates``; ``logprobs`` is [B, V].
- ``sentences_open`` (optional, with ``spelling``): as ``sentences``, plus ``target_chars`` int64 [B, T, C] (C =
  ``spelling.max_chars`` + 2): at a position whose target is a word outside the vocabulary (its id is <unk>'s), the
  word's spelling, ``bow``, the ids of its characters (``spelling.chars[i]`` has id ``first_char_id + i``;
  characters not listed are left out; at most ``max_chars``), ``eow``, padded with ``pad``; all ``pad`` elsewhere.
  Spelled positions score the word itself instead of <unk>: for an ``exact`` bundle its log-probability under the
  softmax over the vocabulary with the word in <unk>'s place (the model as if its vocabulary had held the word; the
  spelled words' probabilities do not add up to <unk>'s), for a self-normalised one its unnormalised score. The
  other positions score as ``sentences`` does. (``training.heads.base.LinearHead.spelled_logprob``.)

The scores of all three graphs are the same function: summing ``step`` scores word by word (then ``</s>``) gives the
``sentences`` score. ``normalisation`` says what that function is, as measured at export
(``training.export.normalisation_label``): ``exact`` — true log-probabilities; ``self-normalised`` — the head's
unnormalised scores (one dot product per word), trained so that they approximate log-probabilities, and measured on
held-out text to do so (``heldout.logz_mean``/``logz_std``: |mean| <= 0.1 and std <= 0.5); or ``unnormalised`` —
such scores whose held-out log Z is further from 0: a usable log-linear feature, but not a log-probability, so
``lm-rescore`` does not mix them with n-gram probabilities word by word unless asked to.

``manifest.json`` fields:

==================  =============================================================================================
format              "lmserve-bundle"
format_version      2 (1 is read too)
created             ISO 8601 time of export
head                output layer: "full", "adaptive", ...
normalisation       "exact", "self-normalised" or "unnormalised" (above)
vocab               {"file", "size", "unk", "bos", "eos"}; version 3 adds "type": "subword" and "subword_model"
                    (the sentencepiece model's file name): the vocabulary lists pieces, the graphs score pieces, and
                    the scorer spells each word alone into its pieces ("▁" + the word) and sums their scores, so a
                    word's score is the sum of its pieces' and nothing is out of vocabulary (byte pieces spell any
                    character; ``rescoring.subword``)
text                how the training text became tokens: {"tokenizer": "whitespace", "lowercase": bool}, or a
                    ``core.textnorm.TextNormalizer`` (``{"tokenizer": "textnorm", ...}``); the scorer
                    applies it to the text it is given unless the caller passes another text normaliser
model               {"layers", "hidden_size", "embedding_size", "projection_size"}
graphs              {"sentences", "step", "step_full"}: file names; "sentences_open" too with ``spelling``
spelling            optional, for heads whose output vectors come from characters (charcnn, cnnsoftmax):
                    {"chars": the characters by id, "first_char_id", "max_chars", "pad", "bow", "eow"}; with it
                    the scorer can score words outside the vocabulary from their spelling (``Scorer(open_vocab=True)``)
direction           optional: "backward" for a model that reads each sentence last word first (``data.direction``): its
                    scorer reverses the words of a sentence before scoring it, and it scores whole sentences only
                    (``lm-rescore annotate`` puts its scores into lists); absent: "forward"
sentence_start      optional: "</s>" for a model trained in stream mode (it read the </s> of the sentence before,
                    never <s>): every scorer starts a sentence, and a decoder its first step, with that token;
                    absent: "<s>"
opset               ONNX opset of the graphs
quantization        null, or "int8-dynamic" (weights int8, activations quantised on the fly)
weights             optional: {"file": "weights.bin", "storage": "fp32" | "fp16" | "int8"}: the graphs keep their
                    large initializers in that file (``training.weight_storage``); fp16 and int8 values are widened
                    to float32 by ``Cast`` (and ``Mul`` by a per-row scale) nodes that ONNX Runtime folds at load, so
                    the graphs compute in float32 whatever the storage. Without it each graph holds its own weights
heldout             measured at export on held-out text, sentence by sentence: {"file", "sentences", "tokens",
                    "oov_rate", "ppl", "ppl_no_oov" (exact, PyTorch fp32), "score_ppl" (exp of minus the mean
                    score of the exported sentences graph: equals ppl for exact fp32 bundles), "logz_mean",
                    "logz_std", "max_abs_diff" (largest |ONNX - PyTorch| per-token score difference); for models
                    trained in stream mode also "stream_ppl" (the same text as one stream, state carried); for
                    subword models "tokens" counts pieces and </s> and "ppl" is per piece, and "words" (words and
                    </s>) and "ppl_per_word" give the perplexity per word}
training            {"checkpoint", "config" (the run's resolved config), "data": [{"path", "bytes", "sha256"}]}
files               {file name: sha256} for every other file of the bundle
==================  =============================================================================================
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

FORMAT = "lmserve-bundle"
FORMAT_VERSION = 2
SUBWORD_FORMAT_VERSION = 3  # an open-vocabulary bundle; word bundles keep version 2
READABLE_VERSIONS = (1, 2, 3)
VOCAB_TYPES = ("word", "subword")
VOCAB_HEADER = "#lmserve-vocab v1"  # also the header of training's vocab.tsv: one vocabulary file format
GRAPHS = ("sentences", "step", "step_full")
MANIFEST_FILE = "manifest.json"
VOCAB_FILE = "vocab.tsv"  # the names export gives the files; a manifest may name others
GRAPH_FILES = {graph: f"{graph}.onnx" for graph in GRAPHS}
OPEN_GRAPH = "sentences_open"  # optional, with the manifest's "spelling"
OPEN_GRAPH_FILE = f"{OPEN_GRAPH}.onnx"
WEIGHTS_FILE = "weights.bin"  # optional: the graphs' shared external data (the manifest's "weights")
WEIGHT_STORAGES = ("fp32", "fp16", "int8")
SPELLING_FIELDS = ("chars", "first_char_id", "max_chars", "pad", "bow", "eow")
NORMALISATIONS = ("exact", "self-normalised", "unnormalised")
DIRECTIONS = ("forward", "backward")
REQUIRED = {
    "format": str,
    "format_version": int,
    "head": str,
    "normalisation": str,
    "vocab": dict,
    "text": dict,
    "model": dict,
    "graphs": dict,
    "heldout": dict,
    "files": dict,
}


class BundleError(ValueError):
    """A bundle is missing, damaged or does not match its manifest; the message names the file and field."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_vocab(path: Path) -> list[str]:
    """Tokens by id from a ``vocab.tsv`` (the counts are for training and sampling, not for scoring)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    if not lines or lines[0] != VOCAB_HEADER:
        raise BundleError(f"{path}:1: expected the header {VOCAB_HEADER!r}")
    tokens = []
    for lineno, line in enumerate(lines[1:], 2):
        token, sep, count = line.partition("\t")
        if not sep or not token or not count.isdigit():
            raise BundleError(f"{path}:{lineno}: expected 'token<TAB>count'")
        tokens.append(token)
    if len(set(tokens)) != len(tokens):
        raise BundleError(f"{path}: a token appears twice")
    return tokens


def inside_bundle(name: object) -> bool:
    """Whether a manifest's file name stays in the bundle folder: a bundle from elsewhere must not make the server
    read ``../../secret`` or ``/etc/passwd`` as its graphs."""
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name:
        return False
    path = PurePosixPath(name)
    return not path.is_absolute() and ".." not in path.parts


@dataclass
class Bundle:
    path: Path
    manifest: dict
    tokens: list[str]

    @property
    def subword_model(self) -> Path | None:
        """The sentencepiece model of an open-vocabulary bundle (format 3), None for a word vocabulary."""
        name = self.manifest["vocab"].get("subword_model")
        return self.path / name if name else None

    @property
    def spells(self) -> bool:
        """Whether the bundle can score words outside its vocabulary from their spelling (``sentences_open``)."""
        return "spelling" in self.manifest

    @property
    def normalisation(self) -> str:
        """The measured label: "exact", "self-normalised" or "unnormalised" (module docstring)."""
        return self.manifest["normalisation"]

    @property
    def normalised(self) -> bool:
        """True when the scores are exact log-probabilities, False when they are (self-)unnormalised ones."""
        return self.normalisation == "exact"

    def graph_path(self, name: str) -> Path:
        return self.path / self.manifest["graphs"][name]

    @classmethod
    def load(cls, path: str | Path, verify_checksums: bool = True) -> Bundle:
        path = Path(path)
        manifest_path = path / MANIFEST_FILE
        if not manifest_path.is_file():
            raise BundleError(f"{path}: not a model bundle (no manifest.json)")
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise BundleError(f"{manifest_path}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}") from e
        validate_manifest(manifest, manifest_path)
        for name, digest in manifest["files"].items():
            file = path / name
            if not file.is_file():
                raise BundleError(f"{file}: missing (listed in manifest.json 'files')")
            if verify_checksums and sha256_file(file) != digest:
                raise BundleError(f"{file}: sha256 does not match manifest.json 'files' (damaged or replaced)")
        tokens = read_vocab(path / manifest["vocab"]["file"])
        vocab = manifest["vocab"]
        if len(tokens) != vocab["size"]:
            raise BundleError(
                f"{path / vocab['file']}: {len(tokens)} tokens, manifest.json vocab.size says {vocab['size']}"
            )
        if tokens[:3] != [vocab["unk"], vocab["bos"], vocab["eos"]]:
            raise BundleError(
                f"{path / vocab['file']}: ids 0-2 are {tokens[:3]}, manifest.json vocab says "
                f"{[vocab['unk'], vocab['bos'], vocab['eos']]}"
            )
        return cls(path, manifest, tokens)


def validate_manifest(manifest: dict, where: Path | str) -> None:
    if not isinstance(manifest, dict):
        raise BundleError(f"{where}: expected a JSON object")
    if manifest.get("format") != FORMAT:
        raise BundleError(f"{where}: field 'format' is {manifest.get('format')!r}, expected {FORMAT!r}")
    if manifest.get("format_version") not in READABLE_VERSIONS:
        raise BundleError(
            f"{where}: format_version {manifest.get('format_version')!r} is not supported "
            f"(this lmserve reads versions {', '.join(map(str, READABLE_VERSIONS))})"
        )
    for field, kind in REQUIRED.items():
        if not isinstance(manifest.get(field), kind):
            raise BundleError(f"{where}: field {field!r} must be a {kind.__name__}, got {manifest.get(field)!r}")
    if manifest["normalisation"] not in NORMALISATIONS:
        raise BundleError(
            f"{where}: field 'normalisation' is {manifest['normalisation']!r}, "
            f"expected one of {', '.join(NORMALISATIONS)}"
        )
    if manifest.get("direction", "forward") not in DIRECTIONS:
        raise BundleError(
            f"{where}: field 'direction' is {manifest['direction']!r}, expected one of {', '.join(DIRECTIONS)}"
        )
    for section, keys in (("vocab", ("file", "size", "unk", "bos", "eos")), ("model", ("layers", "hidden_size"))):
        for field in keys:
            if field not in manifest[section]:
                raise BundleError(f"{where}: field '{section}.{field}' is missing")
    for section, field in (("vocab", "size"), ("model", "layers"), ("model", "hidden_size")):
        value = manifest[section][field]
        if type(value) is not int or value < 1:
            raise BundleError(f"{where}: field '{section}.{field}' = {value!r}: expected a positive integer")
    for name in manifest["files"]:
        if not inside_bundle(name):
            raise BundleError(
                f"{where}: 'files' names {name!r}: expected a file name inside the bundle folder (no '..', no "
                "absolute path)"
            )
    for graph in GRAPHS:
        name = manifest["graphs"].get(graph)
        if name not in manifest["files"]:
            raise BundleError(f"{where}: graphs.{graph} = {name!r} is not listed in 'files'")
    spelling = manifest.get("spelling")
    if (spelling is None) != (OPEN_GRAPH not in manifest["graphs"]):
        raise BundleError(f"{where}: 'spelling' and graphs.{OPEN_GRAPH} go together: one is there without the other")
    if spelling is not None:
        if not isinstance(spelling, dict) or any(field not in spelling for field in SPELLING_FIELDS):
            raise BundleError(f"{where}: field 'spelling' must be an object with {', '.join(SPELLING_FIELDS)}")
        chars = spelling["chars"]
        if not isinstance(chars, list) or not all(isinstance(c, str) and len(c) == 1 for c in chars):
            raise BundleError(f"{where}: field 'spelling.chars' must be a list of single characters")
        for field in ("first_char_id", "max_chars", "pad", "bow", "eow"):
            if type(spelling[field]) is not int or spelling[field] < 0:
                raise BundleError(f"{where}: field 'spelling.{field}' = {spelling[field]!r}: expected an integer >= 0")
        if manifest["graphs"][OPEN_GRAPH] not in manifest["files"]:
            raise BundleError(
                f"{where}: graphs.{OPEN_GRAPH} = {manifest['graphs'][OPEN_GRAPH]!r} is not listed in 'files'"
            )
    weights = manifest.get("weights")
    if weights is not None and (
        not isinstance(weights, dict)
        or weights.get("storage") not in WEIGHT_STORAGES
        or weights.get("file") not in manifest["files"]
    ):
        raise BundleError(
            f"{where}: field 'weights' = {weights!r}: expected {{'file': a file listed in 'files', 'storage': one of "
            f"{', '.join(WEIGHT_STORAGES)}}}"
        )
    if manifest["vocab"]["file"] not in manifest["files"]:
        raise BundleError(f"{where}: vocab.file {manifest['vocab']['file']!r} is not listed in 'files'")
    vocab_type = manifest["vocab"].get("type", "word")
    if vocab_type not in VOCAB_TYPES:
        raise BundleError(f"{where}: field 'vocab.type' is {vocab_type!r}, expected one of {', '.join(VOCAB_TYPES)}")
    if (vocab_type == "subword") != (manifest["format_version"] == SUBWORD_FORMAT_VERSION):
        raise BundleError(
            f"{where}: vocab.type {vocab_type!r} with format_version {manifest['format_version']}: subword "
            f"vocabularies are format {SUBWORD_FORMAT_VERSION} and format {SUBWORD_FORMAT_VERSION} is subword"
        )
    if vocab_type == "subword" and manifest["vocab"].get("subword_model") not in manifest["files"]:
        raise BundleError(
            f"{where}: vocab.subword_model {manifest['vocab'].get('subword_model')!r} is not listed in 'files' "
            "(a subword bundle carries its sentencepiece model)"
        )
