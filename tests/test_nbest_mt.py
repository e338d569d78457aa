"""MT k-best lists: system outputs in the WMT layout and as plain files (distinct candidates, votes, one indicator per
system), fairseq-generate output, HyPoradise's ATIS lists (am_score, ids), and lm-rescore --systems; small files
written here, and one check of the real WMT22 zh-en folder where the shared data is."""

import gzip
import json
import os
import statistics
from pathlib import Path

import pytest
from conftest import ROOT

from lmserve.rescoring.commands.cli import main as rescore_main
from lmserve.rescoring.nbest import (
    FOLDER_FORMATS,
    Hypothesis,
    NBestEntry,
    NBestFormatError,
    NBestList,
    detect_format,
    output_format,
    read_nbest,
    read_systems,
    write_nbest,
)

PREFIX = "newstest.de-en"
SYSTEMS = {  # three systems, three segments: agreement, a tie of two, all different (one empty)
    "Online-B": ["the cat sat", "a dog", "yes"],
    "Lan Bridge": ["the cat sat", "the dog", "no"],
    "AISP": ["the cat sat .", "a dog", ""],
}
SOURCE = ["die Katze sass", "ein Hund", "ja"]
REFS = {"A": ["the cat sat", "a dog", "yes"], "B": ["the cat was sitting", "one dog", "yes indeed"]}


def lines(texts):
    return "".join(t + "\n" for t in texts)


def wmt_folder(root: Path, systems=SYSTEMS, prefix=PREFIX) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{prefix}.src.de").write_text(lines(SOURCE))
    for label, refs in REFS.items():
        (root / f"{prefix}.ref.{label}.en").write_text(lines(refs))
    for system, texts in systems.items():
        (root / f"{prefix}.hyp.{system}.en").write_text(lines(texts))
    return root


def indicators(hyp: Hypothesis) -> dict[str, float]:
    return {name: value for name, value in hyp.features.items() if name.startswith("sys_")}


# --- WMT folders and plain system files ---


def test_wmt_folder_distinct_candidates_votes_and_indicators(tmp_path):
    folder = wmt_folder(tmp_path / "wmt")
    assert detect_format(folder) == "wmt"
    nbest = read_nbest(folder)
    assert [e.id for e in nbest] == ["0", "1", "2"]
    assert nbest.entries[1].source == "ein Hund" and nbest.entries[2].references == ["yes", "yes indeed"]
    names = ["votes", "sys_AISP", "sys_Lan_Bridge", "sys_Online-B"]  # sorted by system; the space sanitised
    assert all(list(h.features) == names for e in nbest for h in e.hypotheses)  # no feature ever missing
    first = nbest.entries[0].hypotheses  # AISP's first (sorted order), then the two that agree
    assert [(h.text, h.rank, h.features["votes"]) for h in first] == [
        ("the cat sat .", 1, 1.0),
        ("the cat sat", 2, 2.0),
    ]
    assert indicators(first[1]) == {"sys_AISP": 0.0, "sys_Lan_Bridge": 1.0, "sys_Online-B": 1.0}
    assert [h.text for h in nbest.entries[1].hypotheses] == ["a dog", "the dog"]
    empty = nbest.entries[2].hypotheses[0]
    assert empty.text == "" and empty.features["votes"] == 1.0 and empty.features["sys_AISP"] == 1.0
    assert [len(e.hypotheses) for e in nbest] == [2, 2, 3]
    assert all(sum(indicators(h).values()) == h.features["votes"] for e in nbest for h in e.hypotheses)


def test_wmt_round_trip_and_a_list_not_from_systems(tmp_path):
    nbest = read_nbest(wmt_folder(tmp_path / "in"))
    out = tmp_path / "out" / PREFIX
    assert "wmt" in FOLDER_FORMATS
    write_nbest(nbest, out, "wmt")
    names = sorted(p.name for p in out.iterdir())
    assert f"{PREFIX}.hyp.Lan_Bridge.en" in names and f"{PREFIX}.src.de" in names and f"{PREFIX}.ref.B.en" in names
    assert (out / f"{PREFIX}.hyp.Online-B.en").read_text() == lines(SYSTEMS["Online-B"])
    assert read_nbest(out).entries == nbest.entries
    write_nbest(nbest, out, "wmt")  # over its own earlier output: allowed

    ranked = NBestList([NBestEntry("0", [Hypothesis("x y", {"lm": -1.0}), Hypothesis("x", {"lm": -2.0})], ["x y"])])
    ranked.entries.append(NBestEntry("1", [Hypothesis("z", {"lm": -3.0})], ["z"]))
    write_nbest(ranked, tmp_path / "plain", "wmt")  # no sys_*: one file per rank, the last hypothesis repeated
    assert (tmp_path / "plain" / "plain.hyp.rank2.tgt").read_text() == "x\nz\n"
    back = read_nbest(tmp_path / "plain")
    assert [h.text for h in back.entries[1].hypotheses] == ["z"] and back.entries[1].hypotheses[0].features == {
        "votes": 2.0,
        "sys_rank1": 1.0,
        "sys_rank2": 1.0,
    }

    lost = read_nbest(tmp_path / "in")
    lost.entries[0].hypotheses[0].features["sys_AISP"] = 0.0  # a hypothesis that no system produced
    with pytest.raises(ValueError, match=r"entry '0': hypothesis 1 came from no system"):
        write_nbest(lost, tmp_path / "bad", "wmt")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="notes.txt"):
        write_nbest(nbest, tmp_path / "foreign", "wmt")


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda d: (d / f"{PREFIX}.hyp.AISP.en").write_text("a\nb\n"), rf"{PREFIX}.hyp.AISP.en:3: has 2 lines, "),
        (lambda d: (d / f"{PREFIX}.ref.B.en").write_text("a\nb\nc\nd\n"), rf"{PREFIX}.ref.B.en:4: has 4 lines, "),
        (lambda d: (d / "wmt21.de-en.hyp.X.en").write_text("a\n"), r"wmt: holds files of two sets, 'newstest.de-en'"),
        (lambda d: [p.unlink() for p in d.glob("*.hyp.*")], r"wmt: holds no PREFIX.hyp.SYSTEM.LANG file"),
        (lambda d: (d / "README").write_text("x\n"), r"wmt/README: is not a file of the WMT layout"),
        (lambda d: (d / f"{PREFIX}.hyp.Z.de").write_text(lines("abc")), rf"{PREFIX}.hyp.Z.de: is in language 'de'"),
        (lambda d: (d / f"{PREFIX}.hyp.Lan_Bridge.en").write_text(lines("abc")), r"both become feature"),
    ],
)
def test_wmt_errors_name_the_file_and_line(tmp_path, damage, expected):
    folder = wmt_folder(tmp_path / "wmt")
    damage(folder)
    with pytest.raises(NBestFormatError, match=expected):
        read_nbest(folder, format="wmt")


def test_wmt_empty_folder_and_detection(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(NBestFormatError, match=r"empty: is an empty folder"):
        read_nbest(tmp_path / "empty", format="wmt")
    with pytest.raises(NBestFormatError, match="cannot tell its n-best format"):
        detect_format(tmp_path / "empty")
    folder = wmt_folder(tmp_path / "numbers", {"sysA": ["1 2 3 go"]})  # SRILM would read '1 2 3 go' as scores
    for p in folder.glob("*.src.*"):
        p.write_text("x\n")
    for p in folder.glob("*.ref.*"):
        p.unlink()
    assert detect_format(folder) == "wmt"


def test_plain_system_files_share_the_dedup(tmp_path):
    paths = []
    for system, texts in SYSTEMS.items():
        path = tmp_path / f"{system.replace(' ', '-')}.txt.gz"
        path.write_bytes(gzip.compress(lines(texts).encode()))
        paths.append(path)
    (tmp_path / "src.de").write_text(lines(SOURCE))
    (tmp_path / "ref.en").write_text(lines(REFS["A"]))
    nbest = read_systems(paths, tmp_path / "src.de", [tmp_path / "ref.en"])
    assert list(nbest.entries[0].hypotheses[0].features) == ["votes", "sys_AISP", "sys_Lan-Bridge", "sys_Online-B"]
    folder = read_nbest(wmt_folder(tmp_path / "wmt"))
    for plain, wmt in zip(nbest, folder, strict=True):
        assert [(h.text, h.features["votes"], h.rank) for h in plain.hypotheses] == [
            (h.text, h.features["votes"], h.rank) for h in wmt.hypotheses
        ]
        assert plain.source == wmt.source and plain.references == wmt.references[:1]
    (tmp_path / "short.en").write_text("a\n")
    with pytest.raises(NBestFormatError, match=r"short.en:2: has 1 lines, .* has 3"):
        read_systems([*paths, tmp_path / "short.en"])
    with pytest.raises(NBestFormatError, match=r"ref.en:4: has 4 lines"):
        (tmp_path / "ref.en").write_text(lines(["a", "b", "c", "d"]))
        read_systems(paths, references=tmp_path / "ref.en")
    with pytest.raises(NBestFormatError, match=r"names system 'AISP'"):
        (tmp_path / "AISP.en").write_text(lines("abc"))
        read_systems([*paths, tmp_path / "AISP.en"])


# --- fairseq-generate ---

FAIRSEQ = """\
2024-05-02 10:11:12 | INFO | fairseq_cli.generate | {'_name': None, 'common': {'no_progress_bar': False}}
2024-05-02 10:11:13 | INFO | fairseq.tasks.translation | [de] dictionary: 42024 types
S-1\tein Hund
T-1\ta dog
H-1\t-0.2513\ta dog
D-1\t-0.2513\ta dog
P-1\t-0.3311 -0.2010 -0.2218
H-1\t-0.9120\tone dog
D-1\t-0.9120\tone dog
P-1\t-1.2011 -0.9012 -0.6337
S-0\tdie Katze sass
T-0\tthe cat sat
H-0\t-0.3051161766052246\tthe c@@ at sat
D-0\t-0.3051161766052246\tthe cat sat
P-0\t-0.4012 -0.2011 -0.3312 -0.2869
A-0\t0-0 1-1 2-2
H-0\t-1.5\t
D-0\t-1.5\t
P-0\t-1.5000
2024-05-02 10:11:20 | INFO | fairseq_cli.generate | NOTE: hypothesis and token scores are output in base 2
2024-05-02 10:11:20 | INFO | fairseq_cli.generate | Translated 2 sentences (9 tokens) in 0.1s (20.00 sentences/s)
Generate test with beam=2: BLEU4 = 61.05, 80.0/66.7/50.0/33.3 (BP=1.000, ratio=1.000, syslen=5, reflen=5)
"""


def test_fairseq_generate_output(tmp_path):
    path = tmp_path / "generate-test.txt"
    path.write_text(FAIRSEQ)
    assert detect_format(path) == "fairseq"
    nbest = read_nbest(path)
    assert [e.id for e in nbest] == ["0", "1"]  # by sentence index, not in printed order
    first = nbest.entries[0]
    assert first.source == "die Katze sass" and first.references == ["the cat sat"]
    assert [(h.text, h.features, h.rank) for h in first.hypotheses] == [
        ("the cat sat", {"score": -0.3051161766052246}, 1),  # D-: detokenised, not H-'s BPE
        ("", {"score": -1.5}, 2),
    ]
    assert [h.text for h in nbest.entries[1].hypotheses] == ["a dog", "one dog"]
    only_h = tmp_path / "old.txt"  # no D- lines: the H- lines
    only_h.write_text("".join(line + "\n" for line in FAIRSEQ.splitlines() if not line.startswith("D-")))
    assert read_nbest(only_h).entries[0].hypotheses[0].text == "the c@@ at sat"

    out = tmp_path / "again.txt"
    write_nbest(nbest, out, "fairseq")
    assert read_nbest(out).entries == nbest.entries and detect_format(out) == "fairseq"


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("H-2\tnan\tx\nD-2\tnan\tx", r"gen.txt:3: field 2 \(score of H-2\): expected a finite number, got 'nan'"),
        ("H-2 -0.5 x", r"gen.txt:3: expected a tab after 'H-2', got a space"),
        ("S-0\tagain\nH-0\t-1\tx\nD-0\t-1\tx", r"gen.txt:3: S-0 appears again"),
        ("H-2\t-1\tx\nH-2\t-2\ty\nD-2\t-1\tx", r"gen.txt:3: sentence 2 has 2 H- lines and 1 D- lines"),
        ("S-2\tonly a source", r"gen.txt:3: entry '2' has no hypotheses"),
    ],
)
def test_fairseq_errors_name_the_line(tmp_path, line, expected):
    path = tmp_path / "gen.txt"
    path.write_text("S-0\tx\nD-0\t-1\tx\n" + line + "\n")
    with pytest.raises(NBestFormatError, match=expected):
        read_nbest(path, format="fairseq")


def test_fairseq_writer_needs_a_score_and_one_reference(tmp_path):
    entry = NBestEntry("a", [Hypothesis("x", {"score": -1.0})], ["r1", "r2"])
    with pytest.raises(ValueError, match="holds one reference"):
        write_nbest(NBestList([entry]), tmp_path / "o.txt", "fairseq")
    entry.references = ["r1"]
    write_nbest(NBestList([entry]), tmp_path / "o.txt", "fairseq")  # an id that is no number: its position
    assert (tmp_path / "o.txt").read_text() == "T-0\tr1\nH-0\t-1.0\tx\nD-0\t-1.0\tx\n"
    entry.hypotheses[0].features = {"lm": -1.0}
    with pytest.raises(ValueError, match="needs a 'score' feature"):
        write_nbest(NBestList([entry]), tmp_path / "o.txt", "fairseq")


# --- HyPoradise ATIS: am_score and ids ---


def atis(tmp_path, items, name="test_atis.json.gz") -> Path:
    path = tmp_path / name
    path.write_bytes(gzip.compress(json.dumps(items).encode()))
    return path


def test_hyporadise_atis_am_score_and_ids(tmp_path):
    items = [
        {
            "id": "i09067ss",
            "input": ["list flights", "list flight"],
            "output": "list flights",
            "am_score": [-0.3, -0.4],
        },
        {"id": "g0w033ss", "input": ["show fares"], "output": "show fares", "am_score": [-0.2]},
    ]
    path = atis(tmp_path, items)
    assert detect_format(path) == "hyporadise" and output_format(path) == "hyporadise"
    nbest = read_nbest(path)
    assert [e.id for e in nbest] == ["i09067ss", "g0w033ss"]
    assert [h.features for h in nbest.entries[0].hypotheses] == [{"am_score": -0.3}, {"am_score": -0.4}]
    out = tmp_path / "out.json.gz"
    write_nbest(nbest, out, "hyporadise")
    assert json.loads(gzip.decompress(out.read_bytes())) == items  # gzipped, ids and am_score written back
    assert read_nbest(out).entries == nbest.entries

    repeated = atis(tmp_path, [items[0], items[0]], "repeated.json.gz")  # ids that are not unique: the index
    assert [e.id for e in read_nbest(repeated)] == ["0", "1"]
    write_nbest(read_nbest(repeated), tmp_path / "plain.json", "hyporadise")
    assert "id" not in json.loads((tmp_path / "plain.json").read_text())[0]
    partial = atis(tmp_path, [items[0], {"input": ["x"]}], "partial.json.gz")
    assert [e.id for e in read_nbest(partial)] == ["0", "1"]
    bad = atis(tmp_path, [items[0], {**items[1], "id": 7}], "bad.json.gz")
    with pytest.raises(NBestFormatError, match=r"bad.json.gz: entry 1: field 'id': expected a string, got 7"):
        read_nbest(bad)
    short = atis(tmp_path, [{**items[0], "am_score": [-0.3]}], "short.json.gz")
    with pytest.raises(NBestFormatError, match=r"entry 0: field 'am_score': expected 2 numbers, got 1"):
        read_nbest(short)


def test_hyporadise_json_gz_that_is_not_gzip_is_not_detected(tmp_path):
    (tmp_path / "fake.json.gz").write_text("[{}]")
    with pytest.raises(NBestFormatError, match="cannot tell its n-best format"):
        detect_format(tmp_path / "fake.json.gz")


# --- lm-rescore --systems ---


def test_cli_systems_and_wmt_folder(tmp_path, capsys):
    systems = {  # a 'good' system that matches the reference, and two that garble it: votes do not decide alone
        "good": [f"the w{i} sat on the mat" for i in range(12)],
        "bad1": [f"a w{i} sat mat" if i % 2 else f"the w{i} sat on the mat" for i in range(12)],
        "bad2": [f"a w{i} sat mat" for i in range(12)],
    }
    paths = []
    for name, texts in systems.items():
        (tmp_path / f"{name}.en").write_text(lines(texts))
        paths.append(str(tmp_path / f"{name}.en"))
    (tmp_path / "ref.en").write_text(lines(systems["good"]))
    (tmp_path / "src.de").write_text(lines(f"die w{i} sass auf der Matte" for i in range(12)))
    weights, out = tmp_path / "w.json", tmp_path / "out.jsonl"
    common = ["--systems", *paths, "--source", str(tmp_path / "src.de"), "--references", str(tmp_path / "ref.en")]
    tune = ["tune", *common, "--metric", "bleu", "--features", "votes,sys_good", "--restarts", "1", "--quiet"]
    assert rescore_main([*tune, "--out", str(weights)]) == 0
    nbest = ["nbest", *common, "--weights", str(weights), "--out", str(out), "--quiet"]
    assert rescore_main(nbest) == 0
    chosen = [json.loads(line)["hypotheses"][0]["text"] for line in out.read_text().splitlines()]
    assert chosen == systems["good"]
    entry = json.loads(out.read_text().splitlines()[0])
    assert entry["source"] == "die w0 sass auf der Matte" and set(entry["hypotheses"][0]["features"]) >= {
        "votes",
        "sys_good",
        "sys_bad1",
        "sys_bad2",
    }
    capsys.readouterr()

    folder = wmt_folder(tmp_path / "wmt")  # the positional LIST takes a WMT folder (detected)
    tune = ["tune", str(folder), "--metric", "bleu", "--features", "votes,length", "--restarts", "1", "--quiet"]
    assert rescore_main([*tune, "--out", str(tmp_path / "wmt.json")]) == 0
    assert "wmt: bleu " in capsys.readouterr().out

    for bad, message in (
        ([], "one of the arguments LIST --systems is required"),
        ([str(folder), "--systems", *paths], "not allowed with argument"),
        ([str(folder), "--source", str(tmp_path / "src.de")], "src.de without --systems"),  # (command.parse_args)
        (["--systems", *paths, "--format", "wmt"], "--format wmt with --systems"),
    ):
        with pytest.raises(SystemExit):
            rescore_main(["nbest", *bad, "--weights", str(weights), "--out", str(tmp_path / "x.jsonl")])
        assert message in capsys.readouterr().err


# --- the real WMT22 zh-en folder ---

SHARED = Path(os.environ.get("LMSERVE_DATA", ROOT.parent / "shared" / "data"))  # as conftest.shared_data finds it
ZH_EN = SHARED / "wmt22-en" / "zh-en"


@pytest.mark.skipif(not ZH_EN.is_dir(), reason=f"the WMT22 outputs are not at {ZH_EN} (set LMSERVE_DATA)")
def test_wmt22_zh_en():
    nbest = read_nbest(ZH_EN, max_words=1000)  # segment 926 runs to 248 words (Online-A)
    assert len(nbest) == 1875
    systems = [name for name in nbest.feature_names() if name.startswith("sys_")]
    assert len(systems) == 12 and "sys_JDExploreAcademy" in systems and "sys_Lan-Bridge" in systems
    assert statistics.mean(len(e.hypotheses) for e in nbest) == pytest.approx(10.4, abs=0.05)
    assert all(len(e.references) == 2 and e.source for e in nbest)
    assert all(sum(h.features["votes"] for h in e.hypotheses) == 12 for e in nbest)
