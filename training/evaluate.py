"""Exact perplexity and log Z statistics of a model on a batched corpus."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from lmserve.training.batching import Batch
from lmserve.training.distributed import Distributed
from lmserve.training.model import LSTMLM


@dataclass
class EvalResult:
    tokens: int  # predicted positions, </s> included
    ppl: float
    ppl_no_oov: float  # positions whose target is <unk> left out
    oov_targets: int
    logz_mean: float  # log Z = score - log p of the target: how far the unnormalised score is from normalised
    logz_std: float

    def to_dict(self) -> dict:
        return asdict(self)


def flatten(hidden: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, B, D]`` hidden states and the batch's targets -> the ``[N, D]``, ``[N]`` positions that count."""
    if batch.mask is None:
        return hidden.reshape(-1, hidden.shape[-1]), batch.targets.reshape(-1)
    return hidden[batch.mask], batch.targets[batch.mask]


@torch.no_grad()
def evaluate(model: LSTMLM, batcher, unk_id: int, dist: Distributed | None = None) -> EvalResult:
    """Exact perplexity over every batch; under torchrun each rank evaluates its share (``eval_batches``) and the
    sums are added up, so the figure is the single-process one whatever the number of ranks."""
    dist = dist or Distributed()
    was_training = model.training
    model.eval()
    head = model.head.frozen()  # a char-CNN head's matrix computed once, not at every batch
    device = next(model.parameters()).device
    nll = nll_oov = logz_sum = logz_sq = 0.0
    tokens = oov = 0
    state = None
    for batch in batcher.eval_batches(dist.rank, dist.world):
        batch = batch.to(device)
        hidden, state = model(batch.inputs, state if batcher.carries_state else None)
        h, targets = flatten(hidden, batch)
        score, log_norms = head.target_terms(h, targets)
        log_z = log_norms.sum(-1).double()
        neg_logprob = log_z - score.double()
        is_oov = targets == unk_id
        nll += neg_logprob.sum().item()
        nll_oov += neg_logprob[is_oov].sum().item()
        logz_sum += log_z.sum().item()
        logz_sq += log_z.pow(2).sum().item()
        tokens += len(targets)
        oov += int(is_oov.sum())
    model.train(was_training)
    nll, nll_oov, logz_sum, logz_sq, tokens, oov = dist.sum([nll, nll_oov, logz_sum, logz_sq, tokens, oov])
    tokens, oov = int(tokens), int(oov)
    mean = logz_sum / tokens
    return EvalResult(
        tokens=tokens,
        ppl=math.exp(nll / tokens),
        ppl_no_oov=math.exp((nll - nll_oov) / max(1, tokens - oov)),
        oov_targets=oov,
        logz_mean=mean,
        logz_std=math.sqrt(max(0.0, logz_sq / tokens - mean * mean)),
    )
