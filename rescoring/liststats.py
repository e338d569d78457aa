"""What a list looks like to its weights, so that ``lm-rescore nbest`` can say when a list is not like the ones the
weights were tuned on.

Tuned weights are tied to the lists they were tuned on: a weight per unit of a first-pass score means little for a
decoder whose scores span ten times the range, a length weight set on 30-best lists of near-equal lengths can
dominate 5-best lists whose hypotheses differ by whole phrases, and a weight vector tuned on 30 hypotheses an entry
meets other ties on 5. ``tune`` records, in the weights file (``list_statistics``):

- ``hypotheses_per_entry``: mean, min and max;
- ``length_ratio``: per entry the mean over its hypotheses of words(hypothesis) / words(1-best) (an empty 1-best
  counts as one word), averaged over entries;
- ``features``: per score the list carries and the weights read (directly or through a definition), its values'
  5th, 50th and 95th percentiles and its spread within a list (the standard deviation around each list's mean,
  averaged over lists: what a weight multiplies when it moves a choice).

``nbest`` computes the same on the list it reranks and warns (``compare``) when the hypotheses per entry differ by
more than a factor of ``MAX_SIZE_FACTOR``, the mean length ratio by more than ``MAX_LENGTH_SHIFT``, a feature's
within-list spread by more than a factor of ``MAX_SPREAD_FACTOR``, or a feature's central ranges (5th to 95th
percentile) do not overlap at all. A warning is a prompt to check, not an error: re-tune on lists like these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from lmserve.rescoring.features import LIST_FEATURES, LM_FEATURES, VOTES, parse_consensus
from lmserve.rescoring.nbest import NBestList

MAX_SIZE_FACTOR = 2.0
MAX_LENGTH_SHIFT = 0.1
MAX_SPREAD_FACTOR = 3.0


def carried_features(names: Sequence[str], definitions: Mapping[str, Mapping[str, float]], nbest: NBestList) -> list:
    """The scores of the list's own that ``names`` read, directly or through definitions (not the LMs', the list
    features computed from text, consensus or system indicators)."""
    carried = set(nbest.feature_names())
    out: dict[str, None] = {}
    for name in names:
        for term in definitions.get(name, {name: 1.0}):
            computed = term in LM_FEATURES or term in LIST_FEATURES or parse_consensus(term) is not None
            if term in carried and not computed and term != VOTES and not term.startswith("sys_"):
                out[term] = None
    return list(out)


def list_statistics(nbest: NBestList, features: Sequence[str] = ()) -> dict:
    """The statistics of ``nbest`` (module docstring), with ``features`` (scores it carries)."""
    sizes = np.array([len(e.hypotheses) for e in nbest], dtype=np.float64)
    ratios = []
    for entry in nbest:
        first = max(1, len(entry.hypotheses[0].text.split()))
        ratios.append(np.mean([len(h.text.split()) / first for h in entry.hypotheses]))
    out = {
        "entries": len(nbest),
        "hypotheses_per_entry": {"mean": float(sizes.mean()), "min": int(sizes.min()), "max": int(sizes.max())},
        "length_ratio": {"mean": float(np.mean(ratios))},
        "features": {},
    }
    for name in features:
        rows = [np.array([h.features[name] for h in e.hypotheses if name in h.features], np.float64) for e in nbest]
        rows = [r[np.isfinite(r)] for r in rows]
        values = np.concatenate([*rows, np.zeros(0)])
        if not len(values):
            continue
        p05, p50, p95 = (float(x) for x in np.percentile(values, [5, 50, 95]))
        spread = float(np.mean([r.std() for r in rows if len(r)]))
        out["features"][name] = {"p05": p05, "p50": p50, "p95": p95, "spread": spread}
    return out


def compare(tuned: Mapping, now: Mapping) -> list[str]:
    """Warnings where ``now`` (this list's statistics) is far from ``tuned`` (the tuning lists')."""
    warnings = []
    a, b = tuned["hypotheses_per_entry"]["mean"], now["hypotheses_per_entry"]["mean"]
    if a > 0 and b > 0 and not 1 / MAX_SIZE_FACTOR <= b / a <= MAX_SIZE_FACTOR:
        warnings.append(
            f"{b:.1f} hypotheses per entry, the weights were tuned on {a:.1f} (x{b / a:.2g}): ties and the weight of "
            "length-like features change with the list's size"
        )
    a, b = tuned["length_ratio"]["mean"], now["length_ratio"]["mean"]
    if abs(b - a) > MAX_LENGTH_SHIFT:
        warnings.append(
            f"hypotheses are {b:.2f} times as long as the 1-best on average, {a:.2f} where the weights were tuned: "
            "the length feature's weight was set for other alternatives"
        )
    for name, t in tuned.get("features", {}).items():
        n = now.get("features", {}).get(name)
        if n is None:
            continue
        if (
            t["spread"] > 0
            and n["spread"] > 0
            and not 1 / MAX_SPREAD_FACTOR <= n["spread"] / t["spread"] <= MAX_SPREAD_FACTOR
        ):
            warnings.append(
                f"feature {name!r} spreads {n['spread']:.3g} within a list, {t['spread']:.3g} where the weights were "
                f"tuned (x{n['spread'] / t['spread']:.2g}): its weight now counts that much more or less"
            )
        elif n["p05"] > t["p95"] or n["p95"] < t["p05"]:
            warnings.append(
                f"feature {name!r} lies in [{n['p05']:.3g}, {n['p95']:.3g}] (5th to 95th percentile), outside "
                f"[{t['p05']:.3g}, {t['p95']:.3g}] where the weights were tuned: another first pass or another scale?"
            )
    return warnings
