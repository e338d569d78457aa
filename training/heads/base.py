"""What every output layer ("head") answers; see docs/design.md, "The output layer is the heart of it"."""

from __future__ import annotations

import abc

import torch
from torch import nn


def rowwise_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(-1)`` for ``[N, D]`` rows, as a batched matmul: ONNX Runtime's ReduceSum mis-shapes an empty
    (N = 0) input, which an adaptive cluster with no targets in the batch produces."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).reshape(-1)


class Head(nn.Module, abc.ABC):
    """Turns hidden states ``[N, D]`` into word scores over a vocabulary of ``vocab_size`` ids.

    ``target_terms`` is the one method a head must make cheap: the unnormalised score of each target and the log
    normalisers of the softmaxes on the target's path (one for a flat softmax, head and cluster for adaptive), with
    ``log p = score - log_norms.sum(-1)``. Training objectives, the self-normalisation penalty, ``target_logprob`` and
    the log Z statistics are all built on it.

    A self-normalised model is served with the unnormalised scores alone: ``target_score`` (a few dot products per
    target, no normaliser) and ``scores`` (the whole vocabulary), both consistent with ``target_terms``.
    """

    vocab_size: int

    def __init__(self):
        super().__init__()
        # The training text's log unigram distribution, once the trainer has handed it over (init_bias). Not saved:
        # the vocabulary with its counts is, and only training (sampled objectives' noise) needs it.
        self.register_buffer("log_prior", None, persistent=False)

    @abc.abstractmethod
    def target_terms(self, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(score ``[N]``, log_norms ``[N, K]``) for the given targets, in float32 also under bf16 autocast: the loss
        rounds the logits to bf16, never its own sums (tests/test_heads.py)."""

    @abc.abstractmethod
    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Exact normalised log-probabilities of the whole vocabulary, ``[N, V]``."""

    @abc.abstractmethod
    def target_score(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The unnormalised score of each target, ``[N]``, at a cost independent of the vocabulary size."""

    @abc.abstractmethod
    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """Unnormalised scores of the whole vocabulary, ``[N, V]`` (``target_score`` is their gather)."""

    @abc.abstractmethod
    def set_prior_bias(self, log_prior: torch.Tensor) -> None:
        """Set the output biases so that a zero hidden state predicts ``log_prior`` ([V], normalised) exactly."""

    def fit_prior(self, log_prior: torch.Tensor) -> None:
        """Heads whose structure comes from word frequencies (class bins, Huffman tree) build it here."""

    def init_bias(self, log_prior: torch.Tensor, set_bias: bool = True) -> None:
        """The trainer hands over the log unigram distribution of the training text, always.

        It is the only way word frequencies reach the output layer, so one call does all that needs them: the head
        keeps the distribution (the noise of sampled objectives), builds its structure from it (``fit_prior``) and,
        with ``set_bias`` (``head.bias_init = "unigram"``), starts its biases at it so that the untrained model
        predicts word frequencies and log Z starts at 0.
        """
        self.log_prior = log_prior.detach().to(torch.float32).clone()
        self.fit_prior(self.log_prior)
        if set_bias:
            self.set_prior_bias(self.log_prior)

    def frozen(self) -> Head:
        """The head as evaluated and exported: heads that compute their output vectors (charcnn, cnnsoftmax) return
        a plain head holding them, precomputed (and their ``speller``); the rest are used as they are."""
        return self

    def speller(self) -> Speller | None:
        """How the head would score a word it does not know, from its spelling: a ``Speller`` for heads whose output
        vectors come from characters (charcnn, cnnsoftmax, and their frozen heads), None for the rest.

        The one addition to the interface for open-vocabulary scoring: ``frozen()`` had made a char-CNN
        head a plain matrix, which can only score the words it was built with; a frozen head now keeps its speller
        beside the matrix, so that evaluation, export and the scorer can ask any head the same question."""
        spelling = self._modules.get("spelling")
        return spelling if isinstance(spelling, Speller) else None

    def candidate_logprobs(self, hidden: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Exact log-probabilities of ``[B, K]`` candidate next words for ``[B, D]`` hidden states. A flat softmax
        normalises once per row; heads whose ``target_logprob`` is cheaper than the whole distribution override this
        to score each candidate on its own."""
        return self.log_probs(hidden).gather(1, candidates)

    def target_logprob(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Exact log-probability of each target, ``[N]``, without the full-vocabulary softmax where the head allows."""
        score, log_norms = self.target_terms(hidden, targets)
        return score - log_norms.sum(-1)


class Speller(nn.Module, abc.ABC):
    """The output vector and bias of any spelled word, in the vocabulary or not.

    ``inventory`` maps characters to ids (from 3: 0, 1, 2 are padding and the word's begin and end markers),
    ``max_chars`` is how many characters of a word are read; ``spell`` makes a word's ids and the bundle carries both,
    so that a torch-free scorer can spell words as the head does (``rescoring.scorer``)."""

    def __init__(self, inventory: dict[str, int], max_chars: int):
        super().__init__()
        self.inventory = dict(inventory)
        self.max_chars = max_chars

    @abc.abstractmethod
    def forward(self, char_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[N, max_chars + 2]`` spellings (``charcnn.spell``, padded with 0) -> (vectors ``[N, D]``, biases ``[N]``)."""


class LinearHead(Head):
    """A head whose word scores are dot products with one output vector per word, plus a bias, less ``log_z``.

    This is what sampled objectives need: the scores of a few words (the targets and a shared sample) without
    touching the rest of the vocabulary. ``log_z`` is NCE's normalising constant Z_c (``head.log_z``, fixed, or
    learned from that start with ``head.learn_log_z``; Labeau & Allauzen 2018): the softmax ignores a constant shift,
    so exact probabilities do not depend on it, but the self-normalised scores a sampled model is served with do.
    """

    def __init__(self, log_z: float = 0.0, learn_log_z: bool = False):
        super().__init__()
        self.log_z_start = float(log_z)
        # learned as an offset from head.log_z: the model's uniform initialisation of every parameter then leaves
        # the start where the config put it
        self.log_z_offset = nn.Parameter(torch.zeros(())) if learn_log_z else None

    @property
    def log_z(self) -> torch.Tensor | float:
        """log Z_c: ``head.log_z``, plus the learned offset with ``head.learn_log_z``."""
        return self.log_z_start if self.log_z_offset is None else self.log_z_start + self.log_z_offset

    @abc.abstractmethod
    def output_vectors(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(output vectors ``[S, D]``, biases ``[S]``) of the given word ids."""

    @abc.abstractmethod
    def output_bias(self) -> nn.Parameter:
        """The ``[V]`` output biases."""

    @abc.abstractmethod
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden · vectorsᵀ + bias`` for the whole vocabulary, ``[N, V]``."""

    def _less_log_z(self, scores: torch.Tensor) -> torch.Tensor:
        """``scores - log_z``. A learned log Z_c is one scalar that every position of a batch moves: backward gives
        it the positions' mean, not their sum. Summed, its gradient dwarfed every other parameter's and took over the
        clipped gradient norm (270 of 275 after 40 PTB batches), so clipping stalled the rest of the model (PTB NCE:
        validation perplexity 208 with Z_c learned, 155 with it fixed at 1, after three epochs)."""
        if self.log_z_offset is None:
            return scores - self.log_z_start if self.log_z_start else scores
        log_z = self.log_z
        rows = scores.shape[0] if scores.dim() else 1
        if self.training and torch.is_grad_enabled() and rows > 1:
            log_z = log_z / rows + (log_z * (1 - 1 / rows)).detach()  # the same value, 1/rows of the gradient
        return scores - log_z

    def scores(self, hidden):
        return self._less_log_z(self.logits(hidden))

    def target_score(self, hidden, targets):
        vectors, bias = self.output_vectors(targets)
        return self._less_log_z(rowwise_dot(vectors, hidden) + bias)

    def sampled_scores(
        self, hidden: torch.Tensor, targets: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The targets' scores ``[N]`` and those of the same ``[S]`` words for every row ``[N, S]`` (one
        ``[N, D] x [D, S]`` product). One gather for both: its backward writes the ``[V, D]`` gradient once, and
        at 200k words that dense gradient, not the product, is what a sampled step costs on a CPU."""
        vectors, bias = self.output_vectors(torch.cat([targets, ids]))
        n = len(targets)
        target = rowwise_dot(vectors[:n], hidden) + bias[:n]
        sampled = nn.functional.linear(hidden, vectors[n:], bias[n:])
        # the loss in float32 under bf16 autocast, as target_terms (tests/test_objectives_sampled.py)
        return self._less_log_z(target.float()), self._less_log_z(sampled.float())

    def target_terms(self, hidden, targets):
        scores = self.scores(hidden).float()  # the loss in float32 under bf16 autocast (tests/test_heads.py)
        return scores.gather(1, targets[:, None]).squeeze(1), torch.logsumexp(scores, dim=-1, keepdim=True)

    def target_logprob(self, hidden, targets):
        # log_softmax, not score - logsumexp: exported to ONNX, LogSoftmax is as accurate as PyTorch while
        # ONNX Runtime's ReduceLogSumExp is ten times less (1e-4 off per token on a 10k vocabulary)
        return self.log_probs(hidden).gather(1, targets[:, None]).squeeze(1)

    def log_probs(self, hidden):
        return torch.log_softmax(self.logits(hidden), dim=-1)

    def spelled_score(self, hidden: torch.Tensor, char_ids: torch.Tensor) -> torch.Tensor:
        """The unnormalised score ``[N]`` of words given by their spellings ``[N, C]`` (``speller``), less log_z like
        ``target_score``: what a self-normalised model serves for a word outside its vocabulary."""
        speller = self.speller()
        if speller is None:
            raise ValueError(f"{type(self).__name__} has no model of spellings: only charcnn and cnnsoftmax heads do")
        vectors, bias = speller(char_ids)
        return self._less_log_z(rowwise_dot(vectors, hidden) + bias)

    def spelled_logprob(self, hidden: torch.Tensor, char_ids: torch.Tensor, unk_id: int) -> torch.Tensor:
        """Exact log-probability ``[N]`` of words outside the vocabulary, each given by its spelling: the softmax over
        the vocabulary with the word in the place of ``unk_id``, whose mass stood for every such word. So each one is a
        true normalised probability, that of the model as if its vocabulary had held the word instead of <unk>; the
        words' probabilities do not add up to <unk>'s (nothing divides that mass among all possible spellings)."""
        spelled = self.spelled_score(hidden, char_ids)
        column = torch.zeros_like(spelled, dtype=torch.long).unsqueeze(1) + unk_id
        scores = self.scores(hidden).scatter(1, column, spelled.unsqueeze(1))
        # log_softmax, accurate in ONNX Runtime (see target_logprob)
        return torch.log_softmax(scores, dim=-1).gather(1, column).squeeze(1)

    @torch.no_grad()
    def set_prior_bias(self, log_prior):
        """Biases at ``log_prior + log_z``, so that the scores of a zero state are the prior itself (log Z = 0)."""
        self.output_bias().copy_(log_prior + self.log_z_start)
        if self.log_z_offset is not None:
            self.log_z_offset.zero_()


def per_candidate(score_fn, hidden: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Apply a per-target ``score_fn(hidden [N, D], targets [N])`` to ``[B, K]`` candidates of ``[B, D]`` rows."""
    rows = hidden.unsqueeze(1) + torch.zeros_like(candidates, dtype=hidden.dtype).unsqueeze(2)  # [B, K, D]
    return score_fn(rows.reshape(-1, hidden.shape[-1]), candidates.reshape(-1)).reshape(candidates.shape)
