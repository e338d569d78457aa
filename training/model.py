"""The LSTM language model: embedding -> dropout -> multi-layer LSTM -> dropout -> [projection] -> head.

Dropout sits on the non-recurrent connections only (Zaremba et al. 2014): PyTorch's LSTM ``dropout`` is applied
between layers, and the two explicit dropouts cover the input and the output of the stack.
"""

from __future__ import annotations

import torch
from torch import nn

from lmserve.training.config import HeadConfig, ModelConfig
from lmserve.training.heads import Head, build_head
from lmserve.training.heads.slim import SlimEmbedding

State = tuple[torch.Tensor, torch.Tensor]


class LSTMLM(nn.Module):
    def __init__(self, vocab_size: int, cfg: ModelConfig, head_cfg: HeadConfig, words: list[str] | None = None):
        """``words`` (the vocabulary's tokens by id) is needed only by heads built from spellings (charcnn)."""
        super().__init__()
        self.embedding = (
            SlimEmbedding(vocab_size, cfg.embedding_size, cfg.input_slim_subvectors, cfg.input_slim_pool)
            if cfg.input_slim_pool
            else nn.Embedding(vocab_size, cfg.embedding_size)
        )
        self.dropout = nn.Dropout(cfg.dropout)
        self.lstm = nn.LSTM(
            cfg.embedding_size, cfg.hidden_size, cfg.layers, dropout=cfg.dropout if cfg.layers > 1 else 0.0
        )
        self.projection = nn.Linear(cfg.hidden_size, cfg.projection_size) if cfg.projection_size else None
        self.head: Head = build_head(head_cfg, cfg.projection_size or cfg.hidden_size, vocab_size, words)
        if cfg.init_range:
            for p in self.parameters():
                nn.init.uniform_(p, -cfg.init_range, cfg.init_range)
        if cfg.tie_embeddings:
            if cfg.input_slim_pool:
                raise ValueError(
                    "model.tie_embeddings: slim input embeddings (model.input_slim_pool) have no matrix to tie"
                )
            if not hasattr(self.head, "tie_to"):
                raise ValueError(f"model.tie_embeddings: head {head_cfg.type!r} has no single output matrix to tie")
            self.head.tie_to(self.embedding)

    def forward(self, inputs: torch.Tensor, state: State | None = None) -> tuple[torch.Tensor, State]:
        """``inputs [T, B]`` -> (top hidden states ``[T, B, D]``, final LSTM state)."""
        output, state = self.lstm(self.dropout(self.embedding(inputs)), state)
        output = self.dropout(output)
        if self.projection is not None:
            output = self.projection(output)
        return output, state
