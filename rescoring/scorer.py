"""The neural scorer: a model bundle run with ONNX Runtime, no torch.

Sentences are scored independently, each as ``<s> w1 .. wn </s>`` from a fresh LSTM state; a sentence's score is the
sum of its n + 1 token scores (the words and ``</s>``). Scores are natural logs; ``log10`` views are provided. Whether
they are exact log-probabilities, self-normalised or unnormalised scores is the bundle's ``normalisation``, measured at
export (``Scorer.normalisation``; ``Scorer.normalised`` is true for exact ones).

Two ways in:

- ``score(sentences)``: batches of similar length through the ``sentences`` graph;
- ``score_nbest(lists)``: hypothesis lists whose members share prefixes (n-best, k-best). The hypotheses of each list
  are merged into a prefix tree and the LSTM reads every distinct prefix once: prefixes shared by several hypotheses
  through the ``step`` graph, all trees of a call advancing together one depth at a time, and each hypothesis' own
  tail through the ``sentences`` graph from its branch state (``Scorer._run_forest``); the scores equal those of
  ``score`` on each hypothesis alone.

With ``open_vocab=True`` a bundle whose head spells (charcnn, cnnsoftmax: its manifest has ``spelling``) scores the
words outside its vocabulary from their spelling instead of as <unk> (``core.bundle``, ``sentences_open``):
each sentence that has one goes through the ``sentences_open`` graph whole, with the spellings of its unknown words;
``SentenceScore.spelled`` counts them. The decoder steps (``next_word_scores``) still read and score them as <unk>.

An open-vocabulary bundle (format 3) scores sentencepiece pieces; both ways spell each word into its pieces
(``rescoring.subword``), run the pieces as above, and give back per-word scores, a word's being the sum of its
pieces'. The tokens of ``encode``, ``score_ids`` and the decoder steps are then pieces.

``device`` says where the graphs run: "cpu" (the default) or "cuda" (onnxruntime-gpu's CUDA provider,
``pip install 'lmserve[gpu]'``; float32 with TF32 off, its scores are within 1e-4 of the CPU's,
tests/test_scorer_gpu.py). It is chosen, never guessed: a scorer asked for CUDA that cannot have it fails when it is
made (:class:`DeviceError`) instead of scoring on the CPU at a fraction of the speed the caller planned for, and a
machine with onnxruntime-gpu still scores on the CPU unless asked. On the GPU, ``precision="fp16"`` computes in float16
on the tensor cores, its scores within a stated bound of float32's instead of 1e-4 (``rescoring.precision``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from lmserve.core.bundle import Bundle, BundleError
from lmserve.core.textnorm import TextNormalizer
from lmserve.rescoring.precision import PrecisionError, check_precision, half_graph
from lmserve.rescoring.subword import EveryWord, WordPieces

LN10 = math.log(10)
UNK, BOS, EOS = 0, 1, 2  # fixed ids of the bundle vocabulary


@dataclass
class SentenceScore:
    words: list[str]  # the tokens the model saw (after the bundle's text settings), without <s> and </s>
    token_logprobs: np.ndarray  # natural log, one per word and a last one for </s>
    oov: int  # words that were not in the vocabulary (scored as <unk>, unless spelled)
    spelled: int = 0  # of those, the ones scored from their spelling (``Scorer(open_vocab=True)``)

    @property
    def logprob(self) -> float:
        return float(self.token_logprobs.sum(dtype=np.float64))

    @property
    def log10prob(self) -> float:
        return self.logprob / LN10

    @property
    def token_log10probs(self) -> np.ndarray:
        return self.token_logprobs / LN10


@dataclass
class ScoringStats:
    """What the scorer did, for throughput reports: LSTM steps run and graph calls made."""

    lstm_steps: int = 0
    calls: int = 0


DEVICES = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}
# TF32 matrix products (the CUDA provider's default on an Ampere or newer GPU) put scores 2e-4 from the CPU's, measured
# on an H100: scoring is float32, as on the CPU
PROVIDER_OPTIONS = {"CUDAExecutionProvider": {"use_tf32": "0"}}
GPU_FIX = "pip uninstall -y onnxruntime && pip install 'lmserve[gpu]' (onnxruntime-gpu replaces onnxruntime)"


class DeviceError(ValueError):
    """The device a scorer was asked for cannot run it; the message names the device, the onnxruntime installed and
    what to do."""


def check_device(device: str) -> str:
    """``device`` if this onnxruntime can run graphs there, else :class:`DeviceError` (before any bundle is read).
    The CPU build of onnxruntime lists no CUDA provider at all; with onnxruntime-gpu the provider is listed whether
    or not a GPU and its libraries are there, which only a session shows (``Scorer._session``)."""
    if device not in DEVICES:
        raise DeviceError(f"device {device!r}: expected one of {list(DEVICES)}")
    available = ort.get_available_providers()
    missing = [p for p in DEVICES[device] if p not in available]
    if missing:
        raise DeviceError(
            f"device {device!r} needs onnxruntime's {missing[0]}, but the installed onnxruntime {ort.__version__} "
            f"has only {', '.join(available)}; for GPU scoring: {GPU_FIX}"
        )
    return device


def default_batch_tokens(bundle: Bundle, device: str = "cpu") -> int:
    """Exact scores hold a [tokens, V] tensor: on the CPU keep it near 16 MB, where the caches still help (on PTB, 512
    tokens a batch scored 40% faster than 8192); self-normalised scores have no such tensor. A GPU wants its batches
    as large as they come: up to 4 GiB of scores (21,474 tokens of a 50k vocabulary), at most 65,536 tokens."""
    if device == "cuda":
        return max(256, min(65536, 2**30 // len(bundle.tokens)))
    if not bundle.normalised:
        return 8192
    return max(256, min(8192, 2**22 // len(bundle.tokens)))


class Scorer:
    """Load a bundle once; score many sentences and hypothesis lists with it."""

    # A call reads single-hypothesis tails through the ``sentences`` graph when they fill this many of its batches,
    # and steps through them otherwise. LibriSpeech dev_other 30-best lists (about 220 tail tokens each) with the int8
    # Gutenberg model (256 tokens a batch), CPU per list, stepped / tails: 5.2 / 5.7 ms in calls of 8 lists, 4.4 / 4.8
    # in 16, 4.0 / 4.1 in 32, 4.5 / 4.4 in 40, 4.5 / 4.1 in 64 (ad hoc, one thread): 32 batches is about 37 lists.
    tails_min_batches = 32

    def __init__(
        self,
        bundle: str | Path | Bundle,
        *,
        threads: int = 0,
        device: str = "cpu",
        max_batch_tokens: int = 0,
        normalizer: TextNormalizer | None = None,
        open_vocab: bool = False,
        precision: str = "fp32",
    ):
        """``normalizer`` turns text into the tokens the model was trained on; by default the bundle's own ``text``
        settings (what its training text looked like). Pass one (e.g. ``PRESETS["ptb"]``) to score text from
        another source, such as ASR hypotheses for a PTB model. ``open_vocab``: score unknown words from their
        spelling (a bundle with ``spelling`` only). ``device``: "cpu" or "cuda" (module docstring).
        ``precision``: "fp32", or "fp16" on "cuda" (``rescoring.precision``)."""
        self.device = check_device(device)
        self.precision = check_precision(precision, device)
        self.bundle = bundle if isinstance(bundle, Bundle) else Bundle.load(bundle)
        manifest = self.bundle.manifest
        self.index = {token: i for i, token in enumerate(self.bundle.tokens)}  # tokens: words, or subword pieces
        # what the LSTM reads before a sentence's first word: <s>, or </s> for a model trained as a stream (it never
        # read <s>, only the </s> that ends the sentence before; ``core.bundle``'s "sentence_start")
        self.start_id = EOS if manifest.get("sentence_start") == "</s>" else BOS
        # a backward LM reads a sentence last word first (``core.bundle``'s "direction"): encode reverses the words
        self.backward = manifest.get("direction") == "backward"
        self.pieces = WordPieces(self.bundle) if self.bundle.subword_model else None
        # the words the model knows, those an n-gram beside it must see as themselves rather than <unk>: all of them
        # with an open vocabulary
        self.known_words = self.index if self.pieces is None else EveryWord()
        if normalizer is None:
            try:
                normalizer = TextNormalizer.from_dict(manifest["text"])
            except ValueError as err:
                raise BundleError(f"{self.bundle.path / 'manifest.json'}: {err}") from err
        self.normalizer = normalizer
        self.max_batch_tokens = max_batch_tokens or default_batch_tokens(self.bundle, device)
        self.stats = ScoringStats()
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or (os.cpu_count() or 1)
        options.inter_op_num_threads = 1
        self.providers = list(DEVICES[device])
        self.options = options
        self.sessions = {name: self._session(name, options) for name in ("sentences", "step", "step_full")}
        self.open_vocab = open_vocab
        if open_vocab:
            self._open_spelling(options)
        self.layers = manifest["model"]["layers"]
        self.state_size = manifest["model"]["hidden_size"]
        self.continues_from_state = "h0" in {i.name for i in self.sessions["sentences"].get_inputs()}
        self._check_graphs()

    def _session(self, name: str, options: ort.SessionOptions) -> ort.InferenceSession:
        """An ONNX Runtime session of one graph; a graph it cannot load (a truncated file whose checksum was updated
        too) is a BundleError naming the file, not onnxruntime's own exception."""
        path = self.bundle.graph_path(name)
        try:
            session = ort.InferenceSession(self.graph_source(name), options, providers=self.session_providers())
        except PrecisionError:  # no onnx to convert with: not the bundle's fault
            raise
        except Exception as e:  # onnxruntime's InvalidProtobuf, Fail, ...: no common base class but Exception
            raise BundleError(f"{path}: ONNX Runtime cannot load the {name!r} graph: {type(e).__name__}: {e}") from e
        if session.get_providers()[0] != self.providers[0]:  # onnxruntime-gpu without a GPU or its CUDA libraries
            raise DeviceError(
                f"device {self.device!r}: onnxruntime {ort.__version__} lists {self.providers[0]} but could not start "
                f"it for {path} (the session fell back to {', '.join(session.get_providers())}; onnxruntime's "
                "warning above says which library failed): check that nvidia-smi sees a GPU and that the CUDA and "
                "cuDNN versions this onnxruntime-gpu was built for are installed, or use device 'cpu'"
            )
        return session

    def graph_source(self, name: str) -> str | bytes:
        """What a session of the ``name`` graph is made from: the bundle's file, or in fp16 the graph rewritten."""
        path = self.bundle.graph_path(name)
        return half_graph(path) if self.precision == "fp16" else str(path)

    def session_providers(self) -> list[tuple[str, dict]]:
        """The providers of the scorer's sessions, each with its options (``PROVIDER_OPTIONS``)."""
        return [(provider, PROVIDER_OPTIONS.get(provider, {})) for provider in self.providers]

    def _open_spelling(self, options: ort.SessionOptions) -> None:
        where = self.bundle.path / "manifest.json"
        if self.pieces is not None:
            raise BundleError(f"{where}: open_vocab is for word vocabularies; a subword bundle has no unknown words")
        if not self.bundle.spells:
            raise BundleError(
                f"{where}: open_vocab needs a bundle that spells words (head charcnn or cnnsoftmax, exported with "
                f"'spelling' and a sentences_open graph); this one's head is {self.bundle.manifest['head']!r}"
            )
        spelling = self.bundle.manifest["spelling"]
        self.char_ids = {c: spelling["first_char_id"] + i for i, c in enumerate(spelling["chars"])}
        self.spelling = spelling
        self.sessions["sentences_open"] = self._session("sentences_open", options)

    def spell(self, word: str) -> list[int]:
        """The character ids the ``sentences_open`` graph reads for a word (``core.bundle``)."""
        sp = self.spelling
        return [sp["bow"], *[self.char_ids[c] for c in word if c in self.char_ids][: sp["max_chars"]], sp["eow"]]

    @property
    def normalised(self) -> bool:
        return self.bundle.normalised

    @property
    def normalisation(self) -> str:
        """The bundle's measured label: "exact", "self-normalised" or "unnormalised" (``core.bundle``)."""
        return self.bundle.normalisation

    @property
    def fingerprint(self) -> str:
        """sha256 (hex) of the manifest's ``files``, every graph and the vocabulary: the same wherever the same bundle
        is loaded and different for any other export, so a decoder state made by one model is recognised by another."""
        files = json.dumps(self.bundle.manifest["files"], sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(files.encode("utf-8")).hexdigest()

    def _check_graphs(self) -> None:
        """The graphs must fit the vocabulary and the manifest's model shape."""
        out = self.sessions["step_full"].get_outputs()[0].shape
        if out[-1] != len(self.bundle.tokens):
            raise BundleError(
                f"{self.bundle.graph_path('step_full')}: scores {out[-1]} words, "
                f"the vocabulary has {len(self.bundle.tokens)}"
            )
        state = {i.name: i.shape for i in self.sessions["step"].get_inputs()}["h"]
        if state[0] != self.layers or state[2] != self.state_size:
            raise BundleError(
                f"{self.bundle.graph_path('step')}: state is {state}, manifest.json model says "
                f"{self.layers} layers of {self.state_size}"
            )

    # -- text -> ids -------------------------------------------------------------------------------------------

    def check_forward(self, use: str) -> None:
        """A backward LM scores whole sentences only, their words reversed: ``use`` (next words for a decoder,
        features beside an n-gram that reads the words in order) needs a forward one."""
        if self.backward:
            raise BundleError(
                f"{self.bundle.path}: a backward LM (manifest.json 'direction') cannot {use}: it scores whole sentences "
                f"only; put its scores into the lists as a feature: lm-rescore annotate LIST --lm {self.bundle.path} "
                "--feature neural_backward --out LIST.jsonl"
            )

    def encode(self, text: str, memo: dict | None = None) -> tuple[list[str], list[int], int]:
        """Words as the model sees them (last word first for a backward LM), their ids (unknown words -> <unk>; with an open vocabulary, every word's
        pieces one after another) and how many were unknown; ``memo``: see ``TextNormalizer.normalize``."""
        words = self.normalizer.normalize(text, memo)
        if self.backward:
            words = words[::-1]
        if self.pieces is not None:
            ids = [i for w in words for i in self.pieces.spell(w)]
        else:
            ids = [self.index.get(w, UNK) for w in words]
        return words, ids, ids.count(UNK)

    def word_scores(self, words: list[str], token_scores: np.ndarray) -> np.ndarray:
        """Per-word scores (and </s>) from the scores of ``encode``'s ids and </s>: the same array for a word
        vocabulary, each word's pieces summed for an open one."""
        return token_scores if self.pieces is None else self.pieces.word_scores(words, token_scores)

    # -- whole sentences ---------------------------------------------------------------------------------------

    def score(self, sentences: Sequence[str]) -> list[SentenceScore]:
        """Each sentence's scores, in batches of similar length."""
        memo: dict = {}
        encoded = [self.encode(s, memo) for s in sentences]
        results: list[SentenceScore | None] = [None] * len(sentences)
        spelled = self._spelled(encoded)
        plain = [i for i in range(len(encoded)) if not spelled[i]]
        for members in self.plan_batches([encoded[i][1] for i in plain]):
            members = [plain[m] for m in members]
            scores = self.score_ids([encoded[i][1] for i in members])
            for row, i in enumerate(members):
                words, ids, oov = encoded[i]
                results[i] = SentenceScore(words, self.word_scores(words, scores[row, : len(ids) + 1].copy()), oov)
        opened = [i for i in range(len(encoded)) if spelled[i]]
        for i, scores in zip(opened, self.score_spelled([encoded[i] for i in opened]), strict=True):
            words, _, oov = encoded[i]
            results[i] = SentenceScore(words, scores, oov, spelled[i])
        return results

    def _spelled(self, encoded: Sequence[tuple[list[str], list[int], int]]) -> list[int]:
        """How many words of each encoded sentence the open-vocabulary graph spells (0 without ``open_vocab``)."""
        if not self.open_vocab:
            return [0] * len(encoded)
        return [sum(w not in self.index for w in words) if oov else 0 for words, _, oov in encoded]

    def score_spelled(self, encoded: Sequence[tuple[list[str], list[int], int]]) -> list[np.ndarray]:
        """Token scores (words and </s>) of encoded sentences through ``sentences_open``, their unknown words
        spelled; batched by length as ``score`` does."""
        out: list[np.ndarray | None] = [None] * len(encoded)
        width = self.spelling["max_chars"] + 2 if encoded else 0
        for members in self.plan_batches([ids for _, ids, _ in encoded]):
            batch = [encoded[i] for i in members]
            steps = max(len(ids) for _, ids, _ in batch) + 1
            inputs = np.full((len(batch), steps), EOS, dtype=np.int64)
            targets = np.full((len(batch), steps), EOS, dtype=np.int64)
            chars = np.full((len(batch), steps, width), self.spelling["pad"], dtype=np.int64)
            inputs[:, 0] = self.start_id
            for row, (words, ids, _) in enumerate(batch):
                inputs[row, 1 : len(ids) + 1] = ids
                targets[row, : len(ids)] = ids
                for t, word in enumerate(words):
                    if word not in self.index:
                        spelled = self.spell(word)
                        chars[row, t, : len(spelled)] = spelled
            lengths = np.array([len(ids) + 1 for _, ids, _ in batch], dtype=np.int64)
            h0, c0 = self.zero_state(len(batch))
            feed = {"input_ids": inputs, "target_ids": targets, "lengths": lengths, "h0": h0, "c0": c0}
            self.stats.lstm_steps += int(lengths.sum())
            self.stats.calls += 1
            scores = self.sessions["sentences_open"].run(None, {**feed, "target_chars": chars})[0]
            for row, i in enumerate(members):
                out[i] = scores[row, : lengths[row]].copy()
        return out

    def plan_batches(self, sentences: Sequence[list[int]]) -> list[list[int]]:
        """Indices of sentences of similar length, at most ``max_batch_tokens`` padded tokens per batch."""
        order = sorted(range(len(sentences)), key=lambda i: len(sentences[i]))
        batches, start = [], 0
        while start < len(order):
            end = start + 1
            while end < len(order) and (end - start + 1) * (len(sentences[order[end]]) + 1) <= self.max_batch_tokens:
                end += 1
            batches.append(order[start:end])
            start = end
        return batches

    def score_ids(
        self, batch: Sequence[list[int]], h0: np.ndarray | None = None, c0: np.ndarray | None = None
    ) -> np.ndarray:
        """Token scores ``[B, T]`` of sentences given as word ids (without the start token and </s>); row b has
        len + 1 scores. Each from a fresh state, or from ``h0``, ``c0`` [L, B, H] (``rescoring.context``)."""
        steps = max(len(ids) for ids in batch) + 1
        inputs = np.full((len(batch), steps), EOS, dtype=np.int64)
        targets = np.full((len(batch), steps), EOS, dtype=np.int64)
        inputs[:, 0] = self.start_id
        for row, ids in enumerate(batch):
            inputs[row, 1 : len(ids) + 1] = ids
            targets[row, : len(ids)] = ids
        lengths = np.array([len(ids) + 1 for ids in batch], dtype=np.int64)
        return self._run_sentences(inputs, targets, lengths, h0, c0)

    def _run_sentences(
        self, inputs: np.ndarray, targets: np.ndarray, lengths: np.ndarray, h0: np.ndarray | None = None, c0=None
    ) -> np.ndarray:
        """The ``sentences`` graph from a zero state, or from ``h0``/``c0`` [L, B, H] (format 2 bundles)."""
        feed = {"input_ids": inputs, "target_ids": targets, "lengths": lengths}
        if self.continues_from_state:
            if h0 is None:
                h0, c0 = self.zero_state(len(lengths))
            feed |= {"h0": h0, "c0": c0}
        elif h0 is not None:
            raise BundleError(f"{self.bundle.path}: a format 1 sentences graph cannot start from a given state")
        self.stats.lstm_steps += int(lengths.sum())
        self.stats.calls += 1
        return self.sessions["sentences"].run(None, feed)[0]

    # -- decoders: one step at a time ----------------------------------------------------------------------------

    def zero_state(self, batch: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """``h``, ``c`` [L, B, H] of a sentence start, to go in with ``prev_ids = <s>``."""
        shape = (self.layers, batch, self.state_size)
        return np.zeros(shape, dtype=np.float32), np.zeros(shape, dtype=np.float32)

    def next_word_scores(
        self,
        prev_ids: np.ndarray,
        h: np.ndarray | ort.OrtValue,
        c: np.ndarray | ort.OrtValue,
        candidates: np.ndarray | None = None,
        *,
        device_states: bool = False,
    ):
        """One run of the ``step`` graph (``step_full`` without ``candidates``): read ``prev_ids`` [B] from the state
        ``h``, ``c`` [L, B, H] and score the next word: ``candidates`` [B, K] -> [B, K], or the whole vocabulary
        [B, V]. Returns the scores and the state after ``prev_ids``, which every candidate continues from.

        The run is IO-bound (onnxruntime's IOBinding): its outputs are made on the scorer's device, and ``h``, ``c``
        may be numpy arrays or OrtValues already there. The scores always come back as numpy (callers rank them in
        Python). The states come back as numpy too, copied from the device here, unless ``device_states``: then as
        the OrtValues on the device, for a caller whose next step reads the same rows in the same order (a beam
        that goes on from each hypothesis' own output state) and so needs no copy either way. The copy stays the
        default because every other caller picks rows out of the states (prefix trees, the server's batches of
        states of many decoders: numpy indexing, which OrtValues do not have) or sends them away as bytes (the
        gRPC state token, ``rescoring.decoder_state``). On the CPU the "copy" is a view of onnxruntime's buffer, and
        a call with numpy states that wants numpy back is a plain run, without the binding's cost."""
        inputs = {"prev_ids": np.asarray(prev_ids, dtype=np.int64), "h": h, "c": c}
        if candidates is not None:
            inputs["candidates"] = np.asarray(candidates, dtype=np.int64)
        session = self.sessions["step" if candidates is not None else "step_full"]
        self.stats.lstm_steps += len(inputs["prev_ids"])
        self.stats.calls += 1
        if self.device == "cpu" and not device_states and not any(isinstance(v, ort.OrtValue) for v in (h, c)):
            # nothing to keep on a device, and the plain run costs ~35 us less a call than a binding (a one-row
            # ScoreNextWords step: 138 against 173 us with the demo model)
            return tuple(session.run(None, inputs))
        binding = session.io_binding()
        for name, value in inputs.items():
            if isinstance(value, ort.OrtValue):
                binding.bind_ortvalue_input(name, value)
            else:  # onnxruntime copies it to the device (none to copy on the CPU)
                binding.bind_cpu_input(name, value)
        for output in session.get_outputs():
            binding.bind_output(output.name, self.device)
        session.run_with_iobinding(binding)
        logprobs, h_out, c_out = binding.get_outputs()
        if device_states:
            return logprobs.numpy(), h_out, c_out
        return logprobs.numpy(), h_out.numpy(), c_out.numpy()

    def score_continuations(
        self, prev_id: int, h: np.ndarray, c: np.ndarray, sequences: Sequence[Sequence[int]]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Token sequences that continue one decoder state: ``prev_id`` read from ``h``, ``c`` [L, H], then each
        sequence's tokens in turn (a candidate word's pieces). Sequences share the steps of their common prefixes:
        one ``step`` run per depth. Returns each sequence's summed score [K] (float64), its last token [K] and the
        state before that token (``h``, ``c`` [L, K, H]): what a decoder state after the sequence holds."""
        return self.score_continuations_batch(np.array([prev_id]), h[:, None], c[:, None], [sequences])[0]

    def score_continuations_batch(
        self, prev_ids: np.ndarray, h: np.ndarray, c: np.ndarray, sequences: Sequence[Sequence[Sequence[int]]]
    ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """:meth:`score_continuations` for B decoder states at once (``prev_ids`` [B], ``h``, ``c`` [L, B, H],
        ``sequences[b]`` the sequences after state b): one prefix tree per state, all trees advancing together, so
        a depth costs one ``step`` run whatever the number of states. Returns one tuple per state."""
        token, parent, child = [int(i) for i in prev_ids], [-(b + 1) for b in range(len(prev_ids))], {}
        ends: list[list[int]] = []
        for root, item in enumerate(sequences):
            ends.append([])
            for sequence in item:
                node = root
                for t in sequence:
                    if (node, t) not in child:
                        child[node, t] = len(token)
                        token.append(int(t))
                        parent.append(node)
                    node = child[node, t]
                ends[-1].append(node)
        token, parent = np.array(token, dtype=np.int64), np.array(parent)
        roots = len(prev_ids)
        depth = np.zeros(len(token), dtype=np.int64)
        for i in range(roots, len(token)):  # parents come before their children
            depth[i] = depth[parent[i]] + 1
        total = np.zeros(len(token))
        after_h = np.zeros((self.layers, len(token), self.state_size), dtype=np.float32)  # state after reading node i
        after_c = np.zeros_like(after_h)
        kids_all = np.arange(roots, len(token))
        for d in range(int(depth.max())):
            kids = kids_all[depth[kids_all] == d + 1]
            kids = kids[np.argsort(parent[kids], kind="stable")]
            steppers = np.unique(parent[kids])
            row = np.searchsorted(steppers, parent[kids])
            rank = np.arange(len(kids)) - np.searchsorted(row, row)  # position among its siblings
            candidates = np.zeros((len(steppers), rank.max() + 1), dtype=np.int64)
            candidates[row, rank] = token[kids]
            if d == 0:  # the roots: node b is state b
                h_in, c_in = h[:, steppers], c[:, steppers]
            else:
                h_in, c_in = after_h[:, parent[steppers]], after_c[:, parent[steppers]]
            scores, h_out, c_out = self.next_word_scores(token[steppers], h_in, c_in, candidates)
            after_h[:, steppers], after_c[:, steppers] = h_out, c_out
            total[kids] = total[parent[kids]] + scores[row, rank]
        out = []
        for item_ends in ends:
            item_ends = np.array(item_ends, dtype=np.int64)
            before = parent[item_ends]
            out.append((total[item_ends], token[item_ends], after_h[:, before], after_c[:, before]))
        return out

    # -- hypothesis lists with shared prefixes ------------------------------------------------------------------

    def score_nbest(self, lists: Sequence[Sequence[str]], max_batch_rows: int = 1024) -> list[list[SentenceScore]]:
        """Each list's hypotheses scored, their shared prefixes read once (:meth:`_run_forest`) on the CPU. On the GPU
        every hypothesis is read whole through ``sentences`` in the GPU's large batches instead: the forest's one
        ``step`` run per depth is a chain of small runs, each waiting for the last, and an H100 scored 30-best lists
        that way only 1.3x as fast as its 16 CPU cores (docs/benchmarks/scorer.md, "The scorer on a GPU")."""
        if self.device == "cuda":
            flat = self.score([h for hyps in lists for h in hyps])
            bounds = np.cumsum([0, *map(len, lists)])
            return [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        forest = _PrefixForest()
        memo: dict = {}
        encoded = [[self.encode(h, memo) for h in hyps] for hyps in lists]
        paths = []
        for hyps in encoded:
            paths.append(forest.add_list([[*ids, EOS] for _, ids, _ in hyps], self.start_id))
        ends = np.array([path[-1] for hyp_paths in paths for path in hyp_paths], dtype=np.int64)
        edge_scores = self._run_forest(forest, ends, max_batch_rows)
        results = [
            [
                SentenceScore(words, self.word_scores(words, edge_scores[path]), oov)
                for (words, _, oov), path in zip(hyps, hyp_paths, strict=True)
            ]
            for hyps, hyp_paths in zip(encoded, paths, strict=True)
        ]
        if self.open_vocab:  # hypotheses with unknown words again, whole, through the open graph
            where = [(i, j) for i, hyps in enumerate(encoded) for j, n in enumerate(self._spelled(hyps)) if n]
            spelled = self.score_spelled([encoded[i][j] for i, j in where])
            for (i, j), scores in zip(where, spelled, strict=True):
                words, _, oov = encoded[i][j]
                results[i][j] = SentenceScore(words, scores, oov, sum(w not in self.index for w in words))
        return results

    def _run_forest(self, forest: _PrefixForest, ends: np.ndarray, max_batch_rows: int) -> np.ndarray:
        """Score every edge of the forest (by child node), each prefix read by the LSTM once.

        Nodes that begin two or more hypotheses are *shared*: they run through the ``step`` graph, all trees
        advancing together one depth at a time, each node from its parent's output state; their children are the
        step's candidates. Below a shared node, a child that only one hypothesis goes through starts a *tail*: the
        rest of that hypothesis, run through the ``sentences`` graph from the shared node's output state, long tails
        of many lists in one batch (a token costs less there than a row of ``step``). Format 1 bundles, whose
        ``sentences`` graph always starts from zero, step through every node instead, and so does a call with too few
        tail tokens to fill ``tails_min_batches`` of its batches.

        One ``step`` run per depth (up to ``max_batch_rows`` nodes), candidates padded to the depth's widest node.
        A padding candidate costs little beside the LSTM step with every head: full and adaptive softmax normalise
        once per row (adaptive: the head, and each cluster a candidate is in), so a pad is a gather; class, tree
        and self-normalised heads spend per candidate a class, a path or a dot product. (Grouping nodes by child
        count, as this did while an adaptive step scored every candidate through the whole head, ran 3x the graph
        calls: a 30-best list alone took 12.4 ms at the median instead of 9.0, and concurrency 32 on the server
        gave 132 lists/s instead of 168.)
        """
        if not forest.token:
            return np.zeros(0, dtype=np.float32)
        token, parent, depth = (np.asarray(x) for x in (forest.token, forest.parent, forest.depth))
        children_of = np.bincount(parent[parent >= 0], minlength=len(token))
        by_depth = np.argsort(depth, kind="stable")
        level_start = np.searchsorted(depth[by_depth], np.arange(depth.max() + 2))
        below = np.bincount(ends, minlength=len(token))  # hypotheses ending at or below each node
        for d in range(depth.max(), 0, -1):
            level = by_depth[level_start[d] : level_start[d + 1]]
            np.add.at(below, parent[level], below[level])
        # Tails pay off when they fill many sentences batches; fewer lists are cheaper stepped through.
        tails = (
            self.continues_from_state and np.count_nonzero(below == 1) >= self.tails_min_batches * self.max_batch_tokens
        )
        edge_scores = np.zeros(len(token), dtype=np.float32)
        pending = _Tails(self, token, edge_scores)
        row_of = np.full(len(token), -1)  # a node's row in its depth's step outputs
        h = c = None
        for d in range(depth.max()):
            level = by_depth[level_start[d] : level_start[d + 1]]
            steps = children_of[level] > 0
            if tails and d > 0:
                steps &= below[level] >= 2
            steppers = level[steps]
            if len(steppers) == 0:
                break
            kids = by_depth[level_start[d + 1] : level_start[d + 2]]
            if d == 0:
                h_in = c_in = np.zeros((self.layers, len(steppers), self.state_size), dtype=np.float32)
            else:
                rows = row_of[parent[steppers]]
                h_in, c_in = h[:, rows], c[:, rows]
            row_of[steppers] = np.arange(len(steppers))
            kids = kids[row_of[parent[kids]] >= 0]  # children of this depth's steppers
            kid_rows = row_of[parent[kids]]
            order = np.argsort(kid_rows, kind="stable")
            kids, kid_rows = kids[order], kid_rows[order]
            rank = np.arange(len(kids)) - np.searchsorted(kid_rows, kid_rows)  # position among its siblings
            h, c = self._step_level(
                token[steppers], h_in, c_in, token[kids], kid_rows, rank, edge_scores, kids, max_batch_rows
            )
            if tails:
                starts = kids[(below[kids] < 2) & (children_of[kids] > 0)]
                rows = row_of[parent[starts]]
                pending.add(starts, _tail_lengths(starts, ends, depth), h[:, rows], c[:, rows])
                pending.flush_if_full()
        pending.flush()
        return edge_scores

    def _step_level(self, prev, h_in, c_in, kid_tokens, kid_rows, rank, edge_scores, kids, max_batch_rows):
        """The ``step`` graph over one depth's nodes, candidates padded to the most children a node has; scores go
        to ``edge_scores[kids]``."""
        candidates = np.zeros((len(prev), rank.max(initial=0) + 1), dtype=np.int64)
        candidates[kid_rows, rank] = kid_tokens
        scores = np.empty(candidates.shape, dtype=np.float32)
        h, c = np.empty_like(h_in), np.empty_like(c_in)
        for start in range(0, len(prev), max_batch_rows):
            rows = slice(start, start + max_batch_rows)
            scores[rows], h[:, rows], c[:, rows] = self.next_word_scores(
                prev[rows], h_in[:, rows], c_in[:, rows], candidates[rows]
            )
        edge_scores[kids] = scores[kid_rows, rank]
        return h, c


def _tail_lengths(starts: np.ndarray, ends: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """Edges below each single-hypothesis node ``starts`` down to its hypothesis' </s> node. Such a tail is a run of
    consecutive node ids (``_PrefixForest``), so its end is the first hypothesis end at or after the start."""
    sorted_ends = np.sort(ends)
    last = sorted_ends[np.searchsorted(sorted_ends, starts)]
    return depth[last] - depth[starts]


class _Tails:
    """Hypothesis tails waiting for the ``sentences`` graph: each a run of node ids (its first node already scored by
    the step that produced its state) and the state it starts from; run in length-sorted batches of at most the
    scorer's ``max_batch_tokens`` once enough have gathered (64 batches' worth: sorted by length in a pool that
    size, tails carry 2% padding; at 8 batches' worth, 5%)."""

    def __init__(self, scorer: Scorer, token: np.ndarray, edge_scores: np.ndarray):
        self.scorer, self.token, self.edge_scores = scorer, token, edge_scores
        self.starts: list[np.ndarray] = []
        self.lengths: list[np.ndarray] = []
        self.h: list[np.ndarray] = []
        self.c: list[np.ndarray] = []
        self.tokens = 0

    def add(self, starts: np.ndarray, lengths: np.ndarray, h: np.ndarray, c: np.ndarray) -> None:
        self.starts.append(starts)
        self.lengths.append(lengths)
        self.h.append(h)
        self.c.append(c)
        self.tokens += int(lengths.sum())

    def flush_if_full(self) -> None:
        if self.tokens >= 64 * self.scorer.max_batch_tokens:
            self.flush()

    def flush(self) -> None:
        if not self.starts:
            return
        starts, lengths = np.concatenate(self.starts), np.concatenate(self.lengths)
        h, c = np.concatenate(self.h, axis=1), np.concatenate(self.c, axis=1)
        order = np.argsort(lengths, kind="stable")
        begin = 0
        while begin < len(order):
            end = begin + 1
            while end < len(order) and (end - begin + 1) * lengths[order[end]] <= self.scorer.max_batch_tokens:
                end += 1
            members = order[begin:end]
            self._run(starts[members], lengths[members], h[:, members], c[:, members])
            begin = end
        self.starts, self.lengths, self.h, self.c, self.tokens = [], [], [], [], 0

    def _run(self, starts: np.ndarray, lengths: np.ndarray, h0: np.ndarray, c0: np.ndarray) -> None:
        steps = int(lengths.max())
        offsets = np.arange(steps)
        valid = offsets[None, :] < lengths[:, None]
        nodes = np.where(valid, starts[:, None] + offsets[None, :], 0)  # the nodes read; their successors follow
        inputs = np.where(valid, self.token[nodes], EOS)
        targets = np.where(valid, self.token[nodes + valid], EOS)
        scores = self.scorer._run_sentences(inputs, targets, lengths.astype(np.int64), h0, c0)
        self.edge_scores[(nodes + 1)[valid]] = scores[valid]


class _PrefixForest:
    """Prefix trees of token ids; node i stands for a prefix ending in ``token[i]`` (roots are the start token).

    Edges are identified by their child node, so a hypothesis is the list of nodes on its path after the root.
    Nodes are numbered in creation order, so a parent comes before its children, and the nodes a hypothesis does not
    share with an earlier one are consecutive: a single-hypothesis tail is a range of node ids.
    """

    def __init__(self):
        self.token: list[int] = []
        self.parent: list[int] = []
        self.depth: list[int] = []

    def add_list(self, hypotheses: list[list[int]], start: int = BOS) -> list[list[int]]:
        """A new tree from one list's hypotheses (ids ending with </s>) under a root that reads ``start``; each
        hypothesis' path after the root.

        In sorted order a hypothesis shares with the whole tree exactly what it shares with the one before it; the
        rest of it becomes new consecutive nodes, each the parent of the next (appended a run at a time: this is
        the scorer's Python hot spot)."""
        root = len(self.token)
        self.token.append(start)
        self.parent.append(-1)
        self.depth.append(0)
        paths: list[list[int]] = [[] for _ in hypotheses]
        previous: list[int] = []
        previous_path: list[int] = []
        for i in sorted(range(len(hypotheses)), key=hypotheses.__getitem__):
            ids = hypotheses[i]
            shared = 0
            limit = min(len(ids), len(previous))
            while shared < limit and ids[shared] == previous[shared]:
                shared += 1
            first = len(self.token)
            new = range(first, first + len(ids) - shared)
            if new:  # a duplicate of the hypothesis before it adds nothing
                self.token.extend(ids[shared:])
                self.parent.append(previous_path[shared - 1] if shared else root)
                self.parent.extend(new[:-1])
            self.depth.extend(range(shared + 1, len(ids) + 1))
            paths[i] = path = previous_path[:shared] + list(new)
            previous, previous_path = ids, path
        return paths
