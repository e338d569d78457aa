"""What every list must be before anything is computed from it, whatever its format: checked once, right after reading.

A reader turns text into hypotheses; these checks turn away what no reader should pass on, because each would give a
wrong answer rather than an error further on:

- no entries, or an entry without hypotheses (nothing to choose from);
- an empty id, or an id twice (references, caches and reports find entries by id; ``lm-serve`` checks the ids of the
  lists it is sent with :func:`check_ids` too);
- a hypothesis that lacks a feature its list-mates (the other hypotheses of its entry) have: a missing log score is
  not 0.0, the best score there is, so it would usually win (a feature that whole entries lack is caught where the
  weights name it: ``rescoring.features.check_features``). ``defaults`` (``lm-rescore --feature-default NAME=VALUE``) names the value to use for one
  feature where it is absent; Moses/Joshua lists are sparse by their definition and their reader fills in 0;
- a feature that is not a finite number (NaN poisons every sum, +inf wins every list);
- a hypothesis longer than ``max_words`` words (default :data:`MAX_WORDS`, the limit ``lm-serve`` also applies, its
  ``limits.max_words``): one runaway hypothesis of a megabyte took 17 s and 5 GB of memory to score.

Each complaint names where the hypothesis came from (``file:line: field``, kept by the readers in ``origin``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from lmserve.core.command import clip
from lmserve.core.words import words as words_of
from lmserve.rescoring.nbest.model import NBestList
from lmserve.rescoring.nbest.parsing import NBestFormatError

MAX_WORDS = 200  # words per hypothesis, offline (--max-words) and in lm-serve (limits.max_words)


def parse_defaults(items: list[str] | None) -> dict[str, float]:
    """``["lm=0", "ctc=-50.5"]`` (``--feature-default``) -> ``{"lm": 0.0, "ctc": -50.5}``."""
    defaults = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not sep or not name.strip() or not math.isfinite(number):
            raise ValueError(f"--feature-default {clip(item)}: expected NAME=NUMBER, e.g. lm=0")
        defaults[name.strip()] = number
    return defaults


def check_ids(ids: Iterable[tuple[str, str]]) -> None:
    """``(id, where it came from)`` of every entry: raise :class:`NBestFormatError` at the first empty id or the first
    id seen before."""
    seen: dict[str, str] = {}
    for entry_id, where in ids:
        if not entry_id:
            raise NBestFormatError(where, f"id {clip(entry_id)} is empty; expected an id for every entry")
        if entry_id in seen:
            raise NBestFormatError(
                where, f"id {clip(entry_id)} appears twice (first at {seen[entry_id]}); expected unique ids"
            )
        seen[entry_id] = where


def check_list(nbest: NBestList, defaults: Mapping[str, float] | None = None, max_words: int = MAX_WORDS) -> None:
    """Raise :class:`NBestFormatError` on the first problem (module docstring); fill in ``defaults`` where a
    hypothesis lacks that feature."""
    defaults = dict(defaults or {})
    if not nbest.entries:
        raise NBestFormatError(nbest.name, "holds no n-best entries; expected at least one")
    places = [entry.origin or f"{nbest.name}: entry {i}" for i, entry in enumerate(nbest)]
    check_ids((entry.id, where) for entry, where in zip(nbest, places, strict=True))
    for entry, where in zip(nbest, places, strict=True):
        if not entry.hypotheses:
            raise NBestFormatError(where, f"entry {clip(entry.id)} has no hypotheses; expected at least one")
        names = set(defaults).union(*(hyp.features for hyp in entry.hypotheses))
        for k, hyp in enumerate(entry.hypotheses):
            words = len(words_of(hyp.text))
            if words > max_words:
                raise NBestFormatError(
                    _place(hyp, where, k),
                    f"a hypothesis of {words} words; at most {max_words} (--max-words; lm-serve's limits.max_words)",
                )
            if len(hyp.features) != len(names):
                for name in names - hyp.features.keys():
                    if name not in defaults:
                        flag = name if clip(name) == repr(name) else "NAME"  # (a name echoed whole only once)
                        raise NBestFormatError(
                            _place(hyp, where, k),
                            f"no feature {clip(name)}, which other hypotheses of its list have; give every "
                            f"hypothesis one, or a value for where it is missing: --feature-default {flag}=VALUE",
                        )
                    hyp.features[name] = defaults[name]
            if not all(map(math.isfinite, hyp.features.values())):
                name = next(n for n, v in hyp.features.items() if not math.isfinite(v))
                raise NBestFormatError(
                    _place(hyp, where, k), f"feature {clip(name)} = {hyp.features[name]}: expected a finite number"
                )


def _place(hyp, where: str, k: int) -> str:
    return hyp.origin or f"{where}: hypothesis {k + 1}"
