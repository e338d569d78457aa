"""The neural scorer: a model bundle run with ONNX Runtime, no torch.

Sentences are scored independently, each as ``<s> w1 .. wn </s>`` from a fresh LSTM state; a sentence's score is the
sum of its n + 1 token scores (the words and ``</s>``). Scores are natural logs; ``log10`` views are provided. Whether
they are exact log-probabilities or self-normalised ones is the bundle's ``normalisation`` (``Scorer.normalised``).

Two ways in:

- ``score(sentences)``: batches of similar length through the ``sentences`` graph;
- ``score_nbest(lists)``: hypothesis lists whose members share prefixes (n-best, k-best). The hypotheses of each list
  are merged into a prefix tree and the ``step`` graph runs once per distinct prefix, all trees of a call advancing
  together one depth at a time; the scores equal those of ``score`` on each hypothesis alone.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from rescoring.bundle import Bundle, BundleError

LN10 = math.log(10)
UNK, BOS, EOS = 0, 1, 2  # fixed ids of the bundle vocabulary


@dataclass
class SentenceScore:
    words: list[str]  # the tokens the model saw (after the bundle's text settings), without <s> and </s>
    token_logprobs: np.ndarray  # natural log, one per word and a last one for </s>
    oov: int  # words that were not in the vocabulary and were scored as <unk>

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


def default_providers() -> list[str]:
    """CUDA when onnxruntime-gpu and a GPU are there, else the CPU."""
    available = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]


class Scorer:
    """Load a bundle once; score many sentences and hypothesis lists with it."""

    def __init__(
        self,
        bundle: str | Path | Bundle,
        *,
        threads: int = 0,
        providers: Sequence[str] | None = None,
        max_batch_tokens: int = 8192,
    ):
        self.bundle = bundle if isinstance(bundle, Bundle) else Bundle.load(bundle)
        manifest = self.bundle.manifest
        self.index = {token: i for i, token in enumerate(self.bundle.tokens)}
        self.lowercase = bool(manifest["text"].get("lowercase", False))
        self.max_batch_tokens = max_batch_tokens
        self.stats = ScoringStats()
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or (os.cpu_count() or 1)
        options.inter_op_num_threads = 1
        self.providers = list(providers or default_providers())
        self.sessions = {
            name: ort.InferenceSession(str(self.bundle.graph_path(name)), options, providers=self.providers)
            for name in ("sentences", "step", "step_full")
        }
        self.layers = manifest["model"]["layers"]
        self.state_size = manifest["model"]["hidden_size"]
        self._check_graphs()

    @property
    def normalised(self) -> bool:
        return self.bundle.normalised

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

    def encode(self, text: str) -> tuple[list[str], list[int], int]:
        """Words as the model sees them, their ids (unknown words -> <unk>) and how many were unknown."""
        words = (text.lower() if self.lowercase else text).split()
        ids = [self.index.get(w, UNK) for w in words]
        return words, ids, ids.count(UNK)

    # -- whole sentences ---------------------------------------------------------------------------------------

    def score(self, sentences: Sequence[str]) -> list[SentenceScore]:
        encoded = [self.encode(s) for s in sentences]
        results: list[SentenceScore | None] = [None] * len(sentences)
        order = sorted(range(len(sentences)), key=lambda i: len(encoded[i][1]))
        start = 0
        while start < len(order):
            end = start + 1
            while end < len(order) and (end - start + 1) * (len(encoded[order[end]][1]) + 1) <= self.max_batch_tokens:
                end += 1
            members = order[start:end]
            scores = self._run_sentences([encoded[i][1] for i in members])
            for row, i in enumerate(members):
                words, ids, oov = encoded[i]
                results[i] = SentenceScore(words, scores[row, : len(ids) + 1].copy(), oov)
            start = end
        return results

    def _run_sentences(self, batch: list[list[int]]) -> np.ndarray:
        steps = max(len(ids) for ids in batch) + 1
        inputs = np.full((len(batch), steps), EOS, dtype=np.int64)
        targets = np.full((len(batch), steps), EOS, dtype=np.int64)
        inputs[:, 0] = BOS
        for row, ids in enumerate(batch):
            inputs[row, 1 : len(ids) + 1] = ids
            targets[row, : len(ids)] = ids
        lengths = np.array([len(ids) + 1 for ids in batch], dtype=np.int64)
        self.stats.lstm_steps += int(lengths.sum())
        self.stats.calls += 1
        return self.sessions["sentences"].run(None, {"input_ids": inputs, "target_ids": targets, "lengths": lengths})[0]

    # -- hypothesis lists with shared prefixes ------------------------------------------------------------------

    def score_nbest(self, lists: Sequence[Sequence[str]], max_batch_rows: int = 1024) -> list[list[SentenceScore]]:
        forest = _PrefixForest()
        encoded = [[self.encode(h) for h in hyps] for hyps in lists]
        leaves = []
        for hyps in encoded:
            root = forest.new_root()
            leaves.append([forest.add(root, [*ids, EOS]) for _, ids, _ in hyps])
        edge_scores = self._run_forest(forest, max_batch_rows)
        results = []
        for hyps, hyp_leaves in zip(encoded, leaves, strict=True):
            results.append(
                [
                    SentenceScore(words, edge_scores[forest.path(leaf)], oov)
                    for (words, _, oov), leaf in zip(hyps, hyp_leaves, strict=True)
                ]
            )
        return results

    def _run_forest(self, forest: _PrefixForest, max_batch_rows: int) -> np.ndarray:
        """Score every edge of the forest: one step per node that has children, a depth at a time."""
        edge_scores = np.zeros(len(forest.token), dtype=np.float32)
        # the state each node's step starts from: its parent's output (zeros for the roots)
        state_in = {}
        frontier = [n for n in forest.roots if forest.children[n]]
        zeros = np.zeros((self.layers, 1, self.state_size), dtype=np.float32)
        while frontier:
            next_frontier = []
            for start in range(0, len(frontier), max_batch_rows):
                nodes = frontier[start : start + max_batch_rows]
                width = max(len(forest.children[n]) for n in nodes)
                candidates = np.zeros((len(nodes), width), dtype=np.int64)
                for row, n in enumerate(nodes):
                    kids = forest.children[n]
                    candidates[row, : len(kids)] = [forest.token[k] for k in kids]
                h = np.concatenate([state_in.get(n, (zeros, zeros))[0] for n in nodes], axis=1)
                c = np.concatenate([state_in.get(n, (zeros, zeros))[1] for n in nodes], axis=1)
                prev = np.array([forest.token[n] for n in nodes], dtype=np.int64)
                scores, h_out, c_out = self.sessions["step"].run(
                    None, {"prev_ids": prev, "h": h, "c": c, "candidates": candidates}
                )
                self.stats.lstm_steps += len(nodes)
                self.stats.calls += 1
                for row, n in enumerate(nodes):
                    for k, kid in enumerate(forest.children[n]):
                        edge_scores[kid] = scores[row, k]
                        if forest.children[kid]:
                            state_in[kid] = (h_out[:, row : row + 1], c_out[:, row : row + 1])
                            next_frontier.append(kid)
                for n in nodes:
                    state_in.pop(n, None)
            frontier = next_frontier
        return edge_scores


class _PrefixForest:
    """Prefix trees of token ids; node i stands for a prefix ending in ``token[i]`` (roots are ``<s>``).

    Edges are identified by their child node, so a hypothesis is the list of nodes on its path after the root.
    """

    def __init__(self):
        self.token: list[int] = []
        self.parent: list[int] = []
        self.children: list[list[int]] = []
        self._child_of: dict[tuple[int, int], int] = {}
        self.roots: list[int] = []

    def _node(self, token: int, parent: int) -> int:
        self.token.append(token)
        self.parent.append(parent)
        self.children.append([])
        return len(self.token) - 1

    def new_root(self) -> int:
        """A new tree (one hypothesis list): its root is the <s> every hypothesis starts from."""
        self.roots.append(self._node(BOS, -1))
        return self.roots[-1]

    def add(self, root: int, ids: list[int]) -> int:
        """Add one hypothesis (ids ending with </s>) under ``root``; return its leaf node."""
        node = root
        for token in ids:
            key = (node, token)
            child = self._child_of.get(key)
            if child is None:
                child = self._node(token, node)
                self._child_of[key] = child
                self.children[node].append(child)
            node = child
        return node

    def path(self, leaf: int) -> list[int]:
        nodes = []
        while self.parent[leaf] != -1:
            nodes.append(leaf)
            leaf = self.parent[leaf]
        return nodes[::-1]
