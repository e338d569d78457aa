"""Synthetic CTC emissions from reference text through a documented character-level noisy channel.

No real acoustic-model emissions of a usable size are public, so the decoding benchmarks make them: every table built
on them says "synthetic emissions" and prints :meth:`Channel.describe`. The channel, per character of the reference
(word separators included), independently and with a seeded generator:

- with probability ``sub``, the character is *confused*: the frames of it put ``peak`` on another label (drawn
  uniformly among the other characters) and ``second`` on the true one;
- else with probability ``dropped``, it is *faint*: its frames put ``peak`` on blank and ``second`` on the true
  character (the greedy path drops it);
- else it is *clear*: ``peak`` on the true character, ``second`` on a random other label;
- after it, with probability ``ins``, an *inserted* character: frames with ``peak`` on a random character and
  ``second`` on blank.

A character lasts ``frames`` frames (1 to ``frames`` drawn uniformly), and a blank frame (``peak`` on blank) follows
each character, so that repeated letters survive CTC's merging. The rest of every frame's mass, ``1 - peak - second``,
is spread evenly over the other labels. The true text is therefore recoverable from the emissions (the true label
keeps ``second`` wherever the greedy path is wrong), and a language model decides how much of it a search recovers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class Channel:
    sub: float = 0.08
    dropped: float = 0.04
    ins: float = 0.03
    peak: float = 0.6
    second: float = 0.3
    frames: int = 2
    seed: int = 0

    def describe(self) -> dict:
        return {"emissions": "synthetic (benchmarks/synthetic_ctc.py)", **asdict(self)}

    def emissions(self, text: str, labels: Sequence[str], rng: np.random.Generator) -> np.ndarray:
        """``[T, len(labels)]`` natural-log CTC posteriors of ``text``; ``labels[0]`` is the blank, ``" "`` the word
        separator (characters without a label are skipped)."""
        index = {label: i for i, label in enumerate(labels)}
        chars = [index[c] for c in " ".join(text.split()) if c in index]
        others = np.array([i for i in range(1, len(labels))])
        rows: list[tuple[int, int]] = []  # (peak label, second label) per frame

        def emit(top: int, second: int) -> None:
            for _ in range(int(rng.integers(1, self.frames + 1))):
                rows.append((top, second))
            rows.append((0, top if top else second))  # the blank after it

        for true in chars:
            u = rng.random()
            if u < self.sub:
                emit(int(rng.choice(others[others != true])), true)
            elif u < self.sub + self.dropped:
                emit(0, true)
            else:
                emit(true, int(rng.choice(others[others != true])))
            if rng.random() < self.ins:
                emit(int(rng.choice(others)), 0)
        rest = (1.0 - self.peak - self.second) / max(len(labels) - 2, 1)
        probs = np.full((len(rows), len(labels)), rest)
        for t, (top, second) in enumerate(rows):
            probs[t, top] = self.peak
            probs[t, second] = self.second if second != top else self.peak + self.second
        probs /= probs.sum(axis=1, keepdims=True)
        return np.log(probs).astype(np.float32)


def clean_emissions(text: str, labels: Sequence[str]) -> np.ndarray:
    """Emissions that spell ``text`` with certainty (two frames a character, a blank after each): for tests."""
    return Channel(sub=0.0, dropped=0.0, ins=0.0, peak=0.97, second=0.02, frames=1).emissions(
        text, labels, np.random.default_rng(0)
    )
