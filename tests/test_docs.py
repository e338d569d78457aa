"""The guide cannot drift from the code: README.md, BENCHMARKS.md and docs/ checked against the programs.

- Every shell block marked as tested (info string ``sh tested``) in the pages that ``docs/index.md`` lists runs as
  written, page by page in the index's order, each block with ``bash -e -o pipefail``, in one scratch checkout: a copy
  of ``configs/`` and ``deploy/`` and an empty ``var/``, beside a ``../shared/data`` of small generated stand-ins with
  the real file names (``STAND_INS``; ``LMSERVE_DATA`` points there too). ``PORT`` is a free port (``PORT + 1`` too).
- Every ``lm-train``, ``lm-rescore`` and ``lm-serve`` command in any shell block of README.md and docs/, tested or
  not, names subcommands and options that the programs' own parsers have.
- Every relative link and ``#anchor`` of README.md, BENCHMARKS.md and docs/ resolves; every summary row of
  BENCHMARKS.md links into docs/benchmarks/.
- README.md is a front page: at most 200 lines, the two commands in its first screen.

The conventions a reader sees are in docs/index.md ("Conventions").
"""

from __future__ import annotations

import argparse
import gzip
import os
import re
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, make_sentences, write_corpus

DOCS = ROOT / "docs"
INDEX = DOCS / "index.md"
TESTED = ("sh", "tested")  # the info string that marks a block as tested
BLOCK_SECONDS = 240  # one block's limit (the demo's training and tuning are the longest, seconds on the stand-ins)
FENCE = re.compile(r"^(?P<fence>`{3,})(?P<info>[^`\n]*)\n(?P<body>.*?)^(?P=fence)[ \t]*$", re.M | re.S)
PROGRAMS = {"lm-train": "training", "lm-rescore": "rescoring", "lm-serve": "server"}


# ---- reading the pages -------------------------------------------------------------------------------------------


def blocks(path: Path) -> list[tuple[tuple[str, ...], str, int]]:
    """The fenced code blocks of a Markdown file: (info words, text, line of the opening fence)."""
    text = path.read_text(encoding="utf-8")
    return [(tuple(m["info"].split()), m["body"], text.count("\n", 0, m.start()) + 1) for m in FENCE.finditer(text)]


def marked_blocks(path: Path) -> list[tuple[str, int]]:
    return [(body, line) for info, body, line in blocks(path) if info == TESTED]


def guide_pages() -> list[Path]:
    """The pages docs/index.md lists in its table of contents, in order (the order a reader follows)."""
    table = INDEX.read_text(encoding="utf-8").split("## Conventions")[0]
    names = re.findall(r"^\| \[[^\]]+\]\(([^)#]+\.md)\)", table, re.M)
    return [DOCS / name for name in names]


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted(DOCS.rglob("*.md"))]


def test_the_index_lists_every_page_and_every_page_has_a_tested_block():
    pages = guide_pages()
    assert pages and all(page.is_file() for page in pages), pages
    listed = {page.name for page in pages}
    unlisted = [p.name for p in DOCS.glob("*.md") if p.name not in listed and p != INDEX]
    assert not unlisted, f"docs pages missing from docs/index.md's table: {unlisted}"
    for page in pages:
        assert marked_blocks(page), f"{page.relative_to(ROOT)}: no ```sh tested block"
    for path in (ROOT / "README.md", INDEX, *DOCS.glob("benchmarks/*.md")):
        assert not marked_blocks(path), f"{path.relative_to(ROOT)}: tested blocks run only in the guide's pages"


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; the rest belongs in docs/"
    first_screen = "\n".join(lines[:30])
    assert "make demo" in first_screen and "make test" in first_screen
    for program in PROGRAMS:
        assert f"## A tour of `{program}`" in lines, program


# ---- links ------------------------------------------------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (letters, digits, '-', '_' kept), spaces as '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_anchors_resolve(path):
    broken = []
    for link in links(path):
        if re.match(r"[a-z]+:", link):  # https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        file = (path.parent / target).resolve() if target else path
        if not file.exists():
            broken.append(f"{link}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{link}: no heading with that anchor in {file.relative_to(ROOT)}")
    assert not broken, f"{path.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_benchmark_summary_row_links_to_its_section():
    summary = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8").split("## Method")[0]
    rows = [line for line in summary.splitlines() if line.startswith("| ") and not line.startswith("| area")]
    assert len(rows) > 40
    unlinked = [row[:80] for row in rows if "](docs/benchmarks/" not in row]
    assert not unlinked, unlinked


# ---- command names and flags ------------------------------------------------------------------------------------

STOP = {"|", "||", "&", "&&", ";", ">", ">>", "<", "(", ")", "2>", "&>"}


def parsers() -> dict[str, argparse.ArgumentParser]:
    from lmserve.rescoring.commands.cli import build_parser as rescoring_parser
    from lmserve.server.cli import build_parser as server_parser
    from lmserve.training.cli import build_parser as training_parser

    return {"lm-train": training_parser(), "lm-rescore": rescoring_parser(), "lm-serve": server_parser()}


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def invocations(script: str) -> list[tuple[str, list[str]]]:
    """(program, the words after it up to the end of its command) of every lm-* command in a shell block."""
    script = re.sub(r"\\\n", " ", script)
    found = []
    for line in script.splitlines():
        try:
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split, lexer.commenters = True, "#"
            words = list(lexer)
        except ValueError:  # an unbalanced quote in prose-like lines: nothing to check
            continue
        for i, word in enumerate(words):
            if " " in word and any(p in word for p in PROGRAMS):  # a quoted command (sbatch --wrap '...')
                found += invocations(word)
            name = Path(word).name
            program = {"lmserve.training": "lm-train", "lmserve.rescoring": "lm-rescore", "lmserve.server": "lm-serve"}
            if i >= 1 and words[i - 1] == "-m" and word in program:
                name = program[word]
            if name in PROGRAMS:
                rest = []
                for w in words[i + 1 :]:
                    if w in STOP:
                        if w == ")" and not rest:  # $(which lm-train) fit ...
                            continue
                        break
                    rest.append(w)
                found.append((name, rest))
    return found


def check_invocation(parser: argparse.ArgumentParser, words: list[str]) -> list[str]:
    """What in ``words`` the parser (and the subcommand parsers it leads to) does not know."""
    problems, chain, skip = [], [parser], 0
    for word in words:
        word = word.strip("[]")
        if skip:
            skip -= 1
            continue
        if not word or word in ("…", "...") or re.fullmatch(r"-?\d+(\.\d*)?", word):
            continue
        if word.startswith("-"):
            option = word.split("=")[0]
            action = next(
                (p._option_string_actions[option] for p in reversed(chain) if option in p._option_string_actions), None
            )
            if action is None:
                problems.append(f"{chain[-1].prog}: no option {option}")
            elif "=" not in word and action.nargs not in (0, "?", "*", "+") and not isinstance(action.nargs, str):
                skip = action.nargs if isinstance(action.nargs, int) else 1
            continue
        choices = subcommands(chain[-1])  # a parser with subcommands takes no other positional word
        if choices and word in choices:
            chain.append(choices[word])
        elif choices:
            problems.append(f"{chain[-1].prog}: no subcommand {word!r} (has {', '.join(choices)})")
            break
    return problems


def test_the_checker_finds_wrong_options_and_subcommands():
    parser = parsers()
    assert check_invocation(parser["lm-rescore"], ["nbest", "x", "--weights", "w", "--out", "o"]) == []
    assert check_invocation(parser["lm-serve"], ["client", "--server", "h:1", "health"]) == []
    assert check_invocation(parser["lm-rescore"], ["ngram", "build", "--order", "3", "--txt", "t"]) != []
    assert check_invocation(parser["lm-train"], ["fitt", "c.toml"]) != []
    assert invocations("torchrun --nproc-per-node=2 $(which lm-train) fit C --out R  # x\nls | lm-rescore score --lm B")
    assert [p for p, _ in invocations("sbatch --wrap 'lm-rescore merge a --out b'")] == ["lm-rescore"]


def test_commands_and_options_in_the_guide_exist():
    parser = parsers()
    problems, checked = [], 0
    for path in (ROOT / "README.md", *sorted(DOCS.glob("*.md"))):
        for info, body, line in blocks(path):
            if not info or info[0] not in ("sh", "bash"):
                continue
            for program, words in invocations(body):
                checked += 1
                problems += [f"{path.relative_to(ROOT)}:{line}: {p}" for p in check_invocation(parser[program], words)]
    assert checked > 100
    assert not problems, "\n".join(problems)


# ---- the stand-in data and the scratch checkout -----------------------------------------------------------------

STAND_INS = (
    "ptb/ptb.train.txt.gz",
    "ptb/ptb.valid.txt.gz",
    "ptb/ptb.test.txt.gz",
    "librispeech-nbest/dev_clean.tar.gz",
    "librispeech-nbest/dev_other.tar.gz",
    "joshua-bn-en/output.gold",
    *(f"joshua-bn-en/reference.en.{i}" for i in range(4)),
)


def corrupted(ref: str, rng: np.random.Generator) -> str:
    words = ref.split()
    words[int(rng.integers(len(words)))] = f"w{int(rng.integers(20, 40))}"
    return " ".join(words)


def write_stand_ins(data: Path) -> None:
    """Small files with the shared data's names and formats, enough for every tested block in seconds."""
    from lmserve.rescoring.nbest import Hypothesis, NBestEntry, NBestList, write_nbest

    # PTB-like text: the conftest bigram language, plus Zipf-distributed words so that the vocabulary passes
    # demo_ptb.toml's adaptive cutoffs (6,000) and lmplz can estimate its discounts
    zipf = np.random.default_rng(7)
    filler = [" ".join(f"w{z}" for z in zipf.zipf(1.05, size=zipf.integers(1, 16))) for _ in range(1100)]
    train = make_sentences(300, seed=1) + filler
    assert len({w for s in train for w in s.split()}) > 6100
    (data / "ptb").mkdir(parents=True)
    for name, sentences in (("train", train), ("valid", make_sentences(40, seed=2)), ("test", make_sentences(40, 3))):
        write_corpus(data / "ptb" / f"ptb.{name}.txt.gz", sentences)

    # LibriSpeech-like ESPnet 5-best lists (upper case): the reference and 4 copies with a word replaced
    (data / "librispeech-nbest").mkdir()
    for name, seed in (("dev_clean", 4), ("dev_other", 5)):
        rng, entries = np.random.default_rng(seed), []
        for i, ref in enumerate(s.upper() for s in make_sentences(30, seed=seed)):
            texts = [ref, *(corrupted(ref, rng).upper() for _ in range(4))]
            decoder, ctc, lm = (rng.normal(mean, 1, size=5) for mean in (-5, -6, -8))
            score = 0.7 * decoder + 0.3 * ctc + 0.3 * lm
            features = {"score": score, "decoder": decoder, "ctc": ctc, "lm": lm}
            order = np.argsort(-score, kind="stable")
            hyps = [Hypothesis(texts[k], {name: float(v[k]) for name, v in features.items()}) for k in order]
            entries.append(NBestEntry(f"1-1-{i:04d}", hyps, [ref]))
        folder = data / "librispeech-nbest" / name
        write_nbest(NBestList(entries, name), folder, "espnet")
        with tarfile.open(folder.with_name(f"{name}.tar.gz"), "w:gz") as tar:
            tar.add(folder, arcname=name)
        shutil.rmtree(folder)

    # a Joshua-like Moses k-best list with 4 references
    (data / "joshua-bn-en").mkdir()
    rng, entries = np.random.default_rng(6), []
    refs = make_sentences(20, seed=6)
    for i, ref in enumerate(refs):
        texts = [ref, *(corrupted(ref, rng) for _ in range(4))]
        lm, tm = rng.normal(-20, 3, size=5), rng.normal(-10, 3, size=5)
        total = 0.5 * lm + tm
        hyps = [
            Hypothesis(texts[k], {"lm_0": float(lm[k]), "tm_pt_0": float(tm[k]), "total": float(total[k])})
            for k in np.argsort(-total, kind="stable")
        ]
        entries.append(NBestEntry(str(i), hyps))
    write_nbest(NBestList(entries), data / "joshua-bn-en" / "output.gold", "moses")
    for r in range(4):
        lines = [ref if r == 0 else corrupted(ref, np.random.default_rng(100 * r + i)) for i, ref in enumerate(refs)]
        (data / "joshua-bn-en" / f"reference.en.{r}").write_text("\n".join(lines) + "\n")
    made = sorted(str(p.relative_to(data)) for p in data.rglob("*") if p.is_file())
    assert made == sorted(STAND_INS), made


def free_port_pair() -> int:
    """A port P with P and P + 1 free (a block may start two replicas)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


class Checkout:
    """The scratch checkout the tested blocks run in, and the pages run so far."""

    def __init__(self, root: Path):
        self.main = root / "main"
        self.main.mkdir()
        for folder in ("configs", "deploy"):
            shutil.copytree(ROOT / folder, self.main / folder)
        (self.main / "var").mkdir()
        self.data = root / "shared" / "data"
        write_stand_ins(self.data)
        self.env = {
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "LMSERVE_DATA": str(self.data),
            "PORT": str(free_port_pair()),
            # one thread for torch (train.threads = 0 follows it): the tests share the machine's cores, and an
            # oversubscribed OpenMP pool trains the demo's model 20x slower
            "OMP_NUM_THREADS": "1",
        }
        self.env.pop("LMSERVE_DEBUG", None)
        self.done: dict[str, str | None] = {}  # page -> None when it passed, else why it failed

    def run_block(self, page: Path, body: str, line: int) -> None:
        where = f"{page.relative_to(ROOT)}:{line}"
        process = subprocess.Popen(
            ["bash", "-e", "-o", "pipefail", "-c", body],
            cwd=self.main,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: servers a block leaves behind are stopped below
        )
        try:
            output, _ = process.communicate(timeout=BLOCK_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            raise AssertionError(
                f"{where}: the tested block ran over {BLOCK_SECONDS} s\n{body}\n{output.decode()[-4000:]}"
            ) from None
        finally:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if process.returncode != 0:
            raise AssertionError(
                f"{where}: the tested block failed (exit {process.returncode})\n{body}\n--- output ---\n"
                + output.decode(errors="replace")[-6000:]
            )

    def run_page(self, page: Path) -> tuple[float, float]:
        """Run ``page``'s tested blocks, after the pages before it in the index (what a reader has done by then)."""
        pages = guide_pages()
        for earlier in pages[: pages.index(page)]:
            if earlier.name not in self.done:
                self.run_page(earlier)
            if self.done[earlier.name] is not None:
                pytest.fail(f"{page.name} needs {earlier.name}, whose tested blocks failed: {self.done[earlier.name]}")
        start, cpu = time.perf_counter(), children_cpu()
        self.done[page.name] = "did not finish"
        for body, line in marked_blocks(page):
            self.run_block(page, body, line)
        self.done[page.name] = None
        return time.perf_counter() - start, children_cpu() - cpu


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Checkout:
    return Checkout(tmp_path_factory.mktemp("docs"))


@pytest.mark.slow  # the guide's commands: trainings, servers
@pytest.mark.parametrize("page", guide_pages(), ids=lambda p: p.stem)
def test_tested_blocks_run(checkout, page):
    if page.name not in checkout.done:
        seconds, cpu = checkout.run_page(page)
        print(f"{page.name}: tested blocks in {seconds:.1f} s ({cpu:.1f} s of CPU)")
    assert checkout.done[page.name] is None, checkout.done[page.name]


def test_stand_ins_have_the_shared_data_file_names(tmp_path):
    write_stand_ins(tmp_path)
    with gzip.open(tmp_path / "ptb" / "ptb.test.txt.gz", "rt") as f:
        assert len(f.read().splitlines()) == 40
