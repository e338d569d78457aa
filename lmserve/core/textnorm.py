"""What a language model sees of a hypothesis: text -> tokens in the form the model was trained on.

An LM only helps rescoring when the hypotheses look like its training text: a PTB model has never seen "it's",
"1987", "mister" or upper case; a Gutenberg model (``training/gutenberg.py``) has only seen LibriSpeech-style
upper-case words with in-word apostrophes. ``TextNormalizer`` bridges that gap, one setting per difference, and
``PRESETS`` names the settings our models need. It only shapes the LM's input: WER and BLEU are computed on the lists'
own words, untouched.

Steps, in order (each off by default, so the default text normaliser only splits text into words: ``core.words``,
any Unicode whitespace, as WER and BLEU split it):

1. ``case``: "keep", "lower" or "upper". Markup ("<unk>") and, with ``numbers="ptb"``, ``N`` keep their case.
2. ``hyphens``: "split" turns a hyphen between two word characters into a space ("thirty-five" -> "thirty five").
3. ``punctuation``: "strip" drops punctuation and symbol characters (Unicode categories P and S) except
   apostrophes and hyphens between word characters, number punctuation between digits ("3.5", "1,000"), and the
   characters in ``keep_symbols``, which stay inside a word ("at&t") and become tokens of their own at its edges
   ("$5" -> "$ 5"). Markup ("<unk>") is left alone, and PTB's bracket escapes ("-lrb-") are dropped. When
   ``split_clitics`` is on (the target is PTB-tokenised) tokens already in PTB form stay too: clitics ("'s", "n't")
   and a lone "'", and acronyms or initials written with periods ("u.s.", "j."). Other abbreviations lose their
   period ("corp." -> "corp"): a word before a full stop looks the same.
4. ``replace``: whole-token substitutions, for spoken forms a corpus writes differently ("mister" -> "mr."); keys
   are matched after steps 1-3, so they are written in the target case without punctuation.
5. ``numbers``: "ptb" replaces number tokens (digits with optional sign and inner ``.,:/``) and "%" by ``N`` as the
   Mikolov PTB does ("5 %" -> "N N"); tokens that merely contain digits stay ("1980s", "30-year"), as in PTB.
   ``spelled_numbers`` also turns runs of spelled-out cardinals (ASR output: "nineteen eighty-seven",
   "one point five") into one ``N``; a lone "zero" .. "nine" stays a word because WSJ text spells those out.
6. ``split_clitics``: PTB tokenisation of contractions: "it's" -> "it 's", "don't" -> "do n't",
   "can't" -> "ca n't", "cannot" -> "can not", "boys'" -> "boys '".

Curly apostrophes become "'" whenever punctuation is stripped or clitics are split, so both spellings behave alike.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from lmserve.core.words import words

CASES = ("keep", "lower", "upper")
PUNCTUATION = ("keep", "strip")
NUMBERS = ("keep", "ptb")
HYPHENS = ("keep", "split")
NUMBER_TOKEN = "N"
TOKENIZER = "textnorm"  # the ``tokenizer`` value of the manifest shape this module writes

_INNER_HYPHEN = re.compile(r"(?<=[^\W_])-(?=[^\W_])")
_NUMBER = re.compile(r"[-+]?(?:\d+(?:[.,:/]\d+)*|[.,]\d+)")
_CLITIC = re.compile(r"n't|'(?:s|re|ve|m|ll|d)", re.IGNORECASE)
_MARKUP = re.compile(r"<[^<>\s]+>")
_ACRONYM = re.compile(r"(?:[^\W\d_]\.)+")
_BRACKET_ESCAPE = re.compile(r"-[lr][rcs]b-", re.IGNORECASE)
_NOT = re.compile(r"(?i)([^\W_]+)(n't)")
_CONTRACTION = re.compile(r"(?i)([^\W_][\w'-]*?)('(?:s|re|ve|m|ll|d))")
_PLURAL_POSSESSIVE = re.compile(r"(?i)([^\W_][\w'-]*s)(')")
_CANNOT = re.compile(r"(?i)(can)(not)")
_APOSTROPHES = str.maketrans({"’": "'", "‘": "'", "ʼ": "'"})
_NUMBER_PUNCTUATION = ".,:/"

_SMALL = "zero one two three four five six seven eight nine".split()
_CARDINALS = frozenset(
    _SMALL
    + "ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen".split()
    + "twenty thirty forty fifty sixty seventy eighty ninety hundred thousand".split()
)
# Spelled alone, these stay words: WSJ spells out numbers below ten, and "a hundred"/"thousands of" read as words.
_LONE_WORDS = frozenset(_SMALL + ["hundred", "thousand"])


def _word_char(c: str) -> bool:
    """Letters, digits and combining marks (Bengali vowel signs are marks, and part of the word)."""
    return c.isalnum() or unicodedata.category(c).startswith("M")


@dataclass(frozen=True)
class TextNormalizer:
    """One text form, as settings (module docstring); ``normalize`` gives the tokens an LM of that form expects."""

    case: str = "keep"
    punctuation: str = "keep"
    keep_symbols: str = ""
    hyphens: str = "keep"
    replace: tuple[tuple[str, str], ...] = field(default=())
    numbers: str = "keep"
    spelled_numbers: bool = False
    split_clitics: bool = False

    def __post_init__(self) -> None:
        for name, allowed in (
            ("case", CASES),
            ("punctuation", PUNCTUATION),
            ("numbers", NUMBERS),
            ("hyphens", HYPHENS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"text normaliser: {name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.spelled_numbers and self.numbers != "ptb":
            raise ValueError("text normaliser: spelled_numbers needs numbers='ptb': both write PTB's N")
        pairs = self.replace.items() if isinstance(self.replace, Mapping) else self.replace
        object.__setattr__(self, "replace", tuple((str(a), str(b)) for a, b in pairs))

    # -- text -> tokens ----------------------------------------------------------------------------------------

    def normalize(self, text: str, memo: dict[str, tuple[str, ...]] | None = None) -> list[str]:
        """``memo``: a dict that the caller keeps across the texts of one job, where steps 1 and 3 of each word are
        remembered: the hypotheses of a list repeat most of their words (dev_other 30-best lists, a memo per 13 lists:
        0.35 ms a list without, 6% of the CPU that scoring it costs, 0.20 ms with; ad hoc). A memo per job, not
        per text normaliser: a server's would otherwise keep every word it has ever seen."""
        if self.punctuation == "strip" or self.split_clitics:
            text = text.translate(_APOSTROPHES)
        if self.hyphens == "split":
            text = _INNER_HYPHEN.sub(" ", text)
        memo = {} if memo is None else memo
        tokens = []
        for token in words(text):
            pieces = memo.get(token)
            if pieces is None:
                pieces = memo[token] = self._case_and_strip(token)
            tokens.extend(pieces)
        if self.replace:
            table = dict(self.replace)
            tokens = [table.get(t, t) for t in tokens]
        if self.numbers == "ptb":
            tokens = self._numbers(tokens)
        if self.split_clitics:
            tokens = [piece for token in tokens for piece in _split_clitic(token)]
        return tokens

    def _case_and_strip(self, token: str) -> tuple[str, ...]:
        """Steps 1 and 3 of one whitespace token: they depend on nothing else."""
        cased = self._case(token)
        return tuple(self._strip(cased)) if self.punctuation == "strip" else (cased,)

    def cased(self, word: str) -> str:
        """``word`` in this form's case and nothing else changed. A decoder's word is in the model's spelling when
        its tokens, joined by spaces, are this (``rescoring.decoders``): otherwise text normalisation dropped or changed
        characters that the written word keeps."""
        return self._case(word)

    def _case(self, token: str) -> str:
        """Markup ("<unk>") and an existing PTB number token keep their case: they are vocabulary entries."""
        if (
            self.case == "keep"
            or (token[0] == "<" and _MARKUP.fullmatch(token))
            or (token == NUMBER_TOKEN and self.numbers == "ptb")
        ):
            return token
        return token.lower() if self.case == "lower" else token.upper()

    def _strip(self, token: str) -> list[str]:
        if token.isalnum() or _MARKUP.fullmatch(token):
            return [token]
        if self.split_clitics and (token == "'" or _CLITIC.fullmatch(token) or _ACRONYM.fullmatch(token)):
            return [token]
        if _BRACKET_ESCAPE.fullmatch(token):
            return []
        pieces, word = [], []
        for i, c in enumerate(token):
            before = token[i - 1] if i else ""
            after = token[i + 1] if i + 1 < len(token) else ""
            inner = bool(word) and after != "" and _word_char(after)
            if _word_char(c):
                word.append(c)
            elif inner and (c in "'-" or c in self.keep_symbols):
                word.append(c)
            elif inner and c in _NUMBER_PUNCTUATION and before.isdigit() and after.isdigit():
                word.append(c)
            else:
                if word:
                    pieces.append("".join(word))
                    word = []
                if c in self.keep_symbols:
                    pieces.append(c)
        if word:
            pieces.append("".join(word))
        return pieces

    def _numbers(self, tokens: list[str]) -> list[str]:
        out: list[str] = []
        run: list[str] = []  # spelled-out cardinals waiting to become one N

        def flush() -> None:
            trailing = [run.pop()] if run and run[-1].lower() == "point" else []  # "one point" + a stray "point"
            if run:
                out.append(NUMBER_TOKEN if len(run) > 1 or run[0].lower() not in _LONE_WORDS else run[0])
            out.extend(trailing)
            run.clear()

        for token in tokens:
            if self.spelled_numbers and _is_cardinal(token, run):
                run.append(token)
                continue
            if run:
                flush()
            number = token == "%" or (token[-1].isdigit() and _NUMBER.fullmatch(token))
            out.append(NUMBER_TOKEN if number else token)
        flush()
        return out

    # -- manifest ----------------------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """The bundle manifest's ``text`` section."""
        d = asdict(self)
        d["replace"] = dict(self.replace)
        return {"tokenizer": TOKENIZER, **d}

    @classmethod
    def from_dict(cls, d: Mapping) -> TextNormalizer:
        """Read a manifest ``text`` section: this module's shape, or the older ``{"tokenizer": "whitespace",
        "lowercase": bool}`` that bundles were first written with (whitespace split, optional lower case)."""
        d = dict(d)
        tokenizer = d.pop("tokenizer", None)
        if tokenizer == "whitespace":
            lowercase = d.pop("lowercase", False)
            if d or not isinstance(lowercase, bool):
                raise ValueError(
                    f"text section: the whitespace tokenizer takes only 'lowercase' (a bool), got {dict(d)}"
                )
            return cls(case="lower" if lowercase else "keep")
        if tokenizer != TOKENIZER:
            raise ValueError(f"text section: tokenizer must be 'whitespace' or {TOKENIZER!r}, got {tokenizer!r}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"text section: unknown field(s) {unknown}; expected some of {sorted(known)}")
        return cls(**d)


def _is_cardinal(token: str, run: list[str]) -> bool:
    """Does ``token`` continue a spelled-out number? "point" only joins after a cardinal ("one point five")."""
    word = token.lower()
    if word in _CARDINALS:
        return True
    if word == "point":
        return bool(run) and run[-1].lower() != "point"
    return "-" in word and all(part in _CARDINALS for part in word.split("-"))


def _split_clitic(token: str) -> list[str]:
    if ("'" not in token and token.lower() != "cannot") or _CLITIC.fullmatch(token):
        return [token]
    for pattern in (_NOT, _CONTRACTION, _PLURAL_POSSESSIVE, _CANNOT):
        m = pattern.fullmatch(token)
        if m:
            return [m.group(1), m.group(2)]
    return [token]


# Named settings for our models and data. The PTB models were trained on Mikolov's PTB (lower case, numbers as N,
# PTB tokenisation, almost no punctuation besides $ & #); the hypotheses they rescore are WSJ (HyPoradise: lower case,
# spelled-out numbers, "mister", a few $ , .) or Joshua output (tokenised English with . , " -lrb-). The Gutenberg
# models were trained on LibriSpeech-normalised text (training/gutenberg.py: upper-case A-Z, in-word apostrophes
# kept unsplit, hyphens and all other punctuation turned into spaces, no digits), which is exactly LibriSpeech's own
# transcript form, so "gutenberg" and "librispeech" are the same settings: LibriSpeech hypotheses pass through as they
# are and other text is brought to that form.
_LIBRISPEECH = TextNormalizer(case="upper", punctuation="strip", hyphens="split")
PRESETS: dict[str, TextNormalizer] = {
    "none": TextNormalizer(),
    "lower": TextNormalizer(case="lower"),
    "ptb": TextNormalizer(
        case="lower",
        punctuation="strip",
        keep_symbols="$&#%",
        replace={"mister": "mr.", "mr": "mr.", "mrs": "mrs.", "missus": "mrs.", "ms": "ms.", "percent": "%"},
        numbers="ptb",
        spelled_numbers=True,
        split_clitics=True,
    ),
    "librispeech": _LIBRISPEECH,
    "gutenberg": _LIBRISPEECH,
}
