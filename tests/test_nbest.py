"""Every n-best format on small files written here: reading, writing, round trips, detection, and errors that
name the file, the line (or entry) and the field."""

import gzip
import json
import os
import tarfile

import pytest

from lmserve.rescoring.commands.cli import main as rescore_main
from lmserve.rescoring.nbest import (
    FORMATS,
    Hypothesis,
    NBestEntry,
    NBestFormatError,
    NBestList,
    detect_format,
    read_nbest,
    write_nbest,
)
from lmserve.rescoring.nbest.srilm import BYTELOG_TO_LOG10

TEXTS = ["the cat sat", "the cat sad", ""]  # decoders do emit empty hypotheses


def sample(features: tuple[str, ...], references: int = 1, ids=("0", "1")) -> NBestList:
    """Two entries of three hypotheses, feature values that need full precision to survive a round trip."""
    entries = []
    for i, entry_id in enumerate(ids):
        hyps = [
            Hypothesis(text, {name: -(i + 1.0) * (rank + f / 7) / 3 for f, name in enumerate(features)}, rank)
            for rank, text in enumerate(TEXTS, 1)
        ]
        entries.append(NBestEntry(entry_id, hyps, [f"the cat sat {i} {r}" for r in range(references)]))
    return NBestList(entries)


ROUND_TRIPS = {  # format -> what that format holds
    "jsonl": sample(("lm", "am", "total"), references=4, ids=("utt-a", "utt b")),
    "espnet": sample(("score", "decoder", "ctc", "lm"), ids=("1272-128104-0000", "1272-128104-0001")),
    "hyporadise": sample(("score",)),
    "moses": sample(("lm_0", "tm_pt_0", "WordPenalty", "total"), references=0),
    "kaldi": sample(("ac_cost", "lm_cost"), ids=("spk1-utt1", "spk1-utt2")),
    "srilm": sample(("acoustic", "lm"), references=0, ids=("a", "b")),
}
ROUND_TRIPS["jsonl"].entries[0].source = "die katze sass"
ROUND_TRIPS["jsonl"].entries[1].hypotheses[0].rank = None
ROUND_TRIPS["jsonl"].entries[1].hypotheses[1].features["lm"] = -1.7e308  # finite: ±inf is refused
for hyp in (h for e in ROUND_TRIPS["srilm"] for h in e.hypotheses):
    hyp.features["num_words"] = float(len(hyp.text.split()))


def target(tmp_path, format):
    return tmp_path / {"jsonl": "list.jsonl", "hyporadise": "list.json", "moses": "list.kbest"}.get(format, "dump")


@pytest.mark.parametrize("format", ROUND_TRIPS)
def test_round_trip(tmp_path, format):
    original = ROUND_TRIPS[format]
    path = target(tmp_path, format)
    write_nbest(original, path, format)
    assert detect_format(path) == format
    again = read_nbest(path)
    assert again.entries == original.entries and again.name == str(path)
    write_nbest(again, path, format)  # over its own output
    assert read_nbest(path).entries == original.entries
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


def test_model_helpers():
    nbest = sample(("lm", "am"))
    nbest.entries[1].hypotheses[0].features["oov"] = 1.0
    assert len(nbest) == 2 and [e.id for e in nbest] == ["0", "1"] and nbest.num_hypotheses == 6
    assert nbest.feature_names() == ["lm", "am", "oov"]
    assert nbest.by_id("1") is nbest.entries[1]
    nbest.entries.append(NBestEntry("2", []))
    assert nbest.by_id("2") is nbest.entries[2]
    with pytest.raises(KeyError):
        nbest.by_id("3")


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "list.jsonl"
    write_nbest(sample(("lm",)), path, "jsonl")
    before = path.read_text()

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_nbest(sample(("am",)), path, "jsonl")
    assert path.read_text() == before and os.listdir(tmp_path) == ["list.jsonl"]


# --- ESPnet ---


def espnet_dump(root, scores_line=None, extra_text_line=None):
    """A two-rank dump as ESPnet writes it; the 'scores' line of rank 2, utterance 2 can be replaced."""
    ids = ["1272-128104-0000", "1272-128104-0001"]
    texts = {1: ["MISTER QUILTER", "NOR IS"], 2: ["MISTER QUILTERS", ""]}
    for rank in (1, 2):
        folder = root / "raw_hypotheses" / f"{rank}best_recog"
        folder.mkdir(parents=True)
        lines = [f"{u} {t}" for u, t in zip(ids, texts[rank], strict=True)] + (
            [extra_text_line] if extra_text_line and rank == 2 else []
        )
        (folder / "text").write_text("\n".join(lines) + "\n")
        (folder / "score").write_text("".join(f"{u} tensor(-{rank}{k}.5)\n" for k, u in enumerate(ids)))
        scores = [f'{u} {{"decoder": "tensor(-0.35)", "ctc": "tensor(-1.6)", "lm": "tensor(-7{rank}.5)"}}' for u in ids]
        if scores_line and rank == 2:
            scores[1] = scores_line
        (folder / "scores").write_text("\n".join(scores) + "\n")
    (root / "references").mkdir()
    (root / "references" / "ref_wer.trn").write_text(
        "NOR IS MISTER QUILTER'S MANNER\t(1272-128104-1272-128104-0001)\nMISTER QUILTER\t(1272-128104-1272-128104-0000)\n"
    )
    return root


def test_espnet_folder_and_tarball(tmp_path):
    root = espnet_dump(tmp_path / "dev")
    with tarfile.open(tmp_path / "dev.tar.gz", "w:gz") as tar:
        tar.add(root, arcname="dev")
    for path in (root, tmp_path / "dev.tar.gz"):
        assert detect_format(path) == "espnet"
        nbest = read_nbest(path)
        first = nbest.by_id("1272-128104-0001")
        assert [h.text for h in first.hypotheses] == ["NOR IS", ""] and [h.rank for h in first.hypotheses] == [1, 2]
        assert first.hypotheses[1].features == {"score": -21.5, "decoder": -0.35, "ctc": -1.6, "lm": -72.5}
        assert first.references == ["NOR IS MISTER QUILTER'S MANNER"]  # matched by id, not by line
        assert nbest.entries[0].references == ["MISTER QUILTER"]


def test_espnet_writer_removes_ranks_of_an_earlier_dump(tmp_path):
    root = espnet_dump(tmp_path / "dev")
    nbest = read_nbest(root)
    for entry in nbest:
        del entry.hypotheses[1:]
    write_nbest(nbest, root, "espnet")
    assert read_nbest(root).entries == nbest.entries


@pytest.mark.parametrize(
    ("scores_line", "expected"),
    [
        (
            '1272-128104-0001 {"decoder": "tensor(abc)"}',
            "field 2 (scores), key 'decoder': expected a finite number, got 'abc'",
        ),
        ("1272-128104-0001 [1, 2]", "field 2 (scores): expected a JSON object of scores"),
        ('1272-128104-9999 {"lm": "tensor(-1)"}', "field 1 (utterance id): expected '1272-128104-0001' (line 2 of"),
    ],
)
def test_espnet_errors_name_file_line_field(tmp_path, scores_line, expected):
    root = espnet_dump(tmp_path / "dev", scores_line)
    with pytest.raises(NBestFormatError) as error:
        read_nbest(root)
    assert str(error.value).startswith(f"{root}/raw_hypotheses/2best_recog/scores:2: {expected}")
    assert (error.value.line, error.value.field) == (2, expected.split(":")[0].removeprefix("field "))


def test_espnet_errors_on_line_counts_and_missing_references(tmp_path):
    with pytest.raises(NBestFormatError, match=r"2best_recog/text: has 3 lines, expected 2"):
        read_nbest(espnet_dump(tmp_path / "a", extra_text_line="1272-128104-0002 EXTRA"))
    root = espnet_dump(tmp_path / "b")
    (root / "references" / "ref_wer.trn").write_text("MISTER QUILTER\t(1272-128104-1272-128104-0000)\n")
    with pytest.raises(NBestFormatError, match=r"ref_wer.trn: no line for utterance '1272-128104-0001'"):
        read_nbest(root)
    (root / "references" / "ref_wer.trn").write_text("MISTER QUILTER 1272-128104-0000\n")
    with pytest.raises(NBestFormatError, match=r"ref_wer.trn:1: field 2 \(utterance id\): expected '<reference> \("):
        read_nbest(root)


def test_espnet_writer_needs_equal_list_sizes_and_one_reference(tmp_path):
    nbest = sample(("score",))
    nbest.entries[0].hypotheses.pop()
    with pytest.raises(ValueError, match="same number of hypotheses"):
        write_nbest(nbest, tmp_path / "d", "espnet")
    with pytest.raises(ValueError, match="one reference per utterance, '0' has 4"):
        write_nbest(sample(("score",), references=4), tmp_path / "d", "espnet")


# --- HyPoradise ---


def test_hyporadise_reads_entries_by_index(tmp_path):
    path = tmp_path / "dev.json"
    items = [
        {"input": ["a b", "a c"], "output": "a b", "score": [-0.1, -0.2]},
        {"input": ["x"], "output": "y", "score": [-0.5]},
    ]
    path.write_text(json.dumps(items, indent=2))
    nbest = read_nbest(path)
    assert [e.id for e in nbest] == ["0", "1"] and nbest.by_id("1").references == ["y"]
    assert nbest.entries[0].hypotheses[1] == Hypothesis("a c", {"score": -0.2}, 2)


@pytest.mark.parametrize(
    ("item", "expected"),
    [
        ({"input": ["a", "b", "c"], "score": [-1, -2]}, "dev.json: entry 1: field 'score': expected 3 numbers, got 2"),
        ({"input": ["a"], "score": ["x"]}, "dev.json: entry 1: field 'score[0]': expected a finite number, got 'x'"),
        ({"input": "a"}, "dev.json: entry 1: field 'input': expected a list of hypothesis strings"),
        ({"input": ["a"], "output": 3}, "dev.json: entry 1: field 'output': expected the reference string"),
        ([1], "dev.json: entry 1: expected an object with 'input'"),
    ],
)
def test_hyporadise_errors_name_entry_and_field(tmp_path, item, expected):
    path = tmp_path / "dev.json"
    path.write_text(json.dumps([{"input": ["ok"]}, item]))
    with pytest.raises(NBestFormatError) as error:
        read_nbest(path)
    assert str(error.value).startswith(f"{tmp_path}/{expected}")


def test_hyporadise_invalid_json_names_the_line(tmp_path):
    path = tmp_path / "dev.json"
    path.write_text('[\n  {"input": ["a"]},\n  {"input": ["b"],,}\n]')
    with pytest.raises(NBestFormatError, match=r"dev.json:3: column \d+: not valid JSON"):
        read_nbest(path)


# --- Moses / Joshua ---

JOSHUA = """\
0 ||| rabindranath was born ||| lm_0=-27.184 tm_pt_0=-0.000 WordPenalty=-5.646 OOVPenalty=2.000 ||| -227.217
0 ||| rabindranath born ||| lm_0=-28.078 tm_pt_0=-1.5 WordPenalty=-6.080 ||| -228.133
1 ||| he went ||| lm_0=-5.5 tm_pt_0=-0.25 WordPenalty=-2.1 ||| -20.5
"""


def test_moses_sparse_features_and_references(tmp_path):
    path = tmp_path / "output.gold"
    path.write_text(JOSHUA)
    refs = []
    for r in range(2):
        refs.append(tmp_path / f"reference.en.{r}")
        refs[-1].write_text(f"rabindranath was born {r}\nhe went {r}\n")
    nbest = read_nbest(path, references=refs)
    assert [e.id for e in nbest] == ["0", "1"] and nbest.num_hypotheses == 3
    first = nbest.entries[0].hypotheses[0]
    assert first.text == "rabindranath was born" and first.rank == 1
    assert first.features == {
        "lm_0": -27.184,
        "tm_pt_0": -0.0,
        "WordPenalty": -5.646,
        "OOVPenalty": 2.0,
        "total": -227.217,
    }
    assert nbest.by_id("1").references == ["he went 0", "he went 1"]
    assert read_nbest(path, references=refs[0]).entries[1].references == ["he went 0"]
    assert read_nbest(path).entries[0].references == []


def test_moses_dense_features(tmp_path):
    path = tmp_path / "nbest.txt"
    path.write_text(
        "3 ||| das haus ||| d: 0 -4 lm: -15.5 w: -2 tm: -1 -2.5 ||| -3.25 ||| 0-0 1-1\n"
        "3 ||| ein haus ||| Distortion0= 0 LM0= -16 ||| -4\n"
    )
    first, second = read_nbest(path).entries[0].hypotheses
    assert first.features == {
        "d_0": 0.0,
        "d_1": -4.0,
        "lm_0": -15.5,
        "w_0": -2.0,
        "tm_0": -1.0,
        "tm_1": -2.5,
        "total": -3.25,
        "Distortion0_0": 0.0,  # sparse: what a line leaves out is 0
        "LM0_0": 0.0,
    }
    assert second.features == dict.fromkeys(first.features, 0.0) | {"LM0_0": -16.0, "total": -4.0}


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("0 ||| a ||| lm_0=abc ||| -1", "kbest:2: field 3 (features): 'lm_0=abc' is not name=number"),
        ("0 ||| a ||| -1.5 lm_0=-2 ||| -1", "kbest:2: field 3 (features): '-1.5' is neither name=number"),
        (
            "0 ||| a ||| tm: -1 x ||| -1",
            "kbest:2: field 3 (features), value 1 of 'tm': expected a finite number, got 'x'",
        ),
        ("0 ||| a ||| =3 ||| -1", "kbest:2: field 3 (features): '=3' has no feature name"),
        ("0 ||| a ||| lm_0=-2 ||| high", "kbest:2: field 4 (total): expected a finite number, got 'high'"),
        ("zero ||| a ||| lm_0=-2 ||| -1", "kbest:2: field 1 (id): expected a sentence number, got 'zero'"),
        ("0 ||| a", "kbest:2: expected 'id ||| hypothesis ||| features ||| total', got 2 field(s)"),
    ],
)
def test_moses_errors_name_line_and_field(tmp_path, line, expected):
    path = tmp_path / "kbest"
    path.write_text(f"0 ||| ok ||| lm_0=-1 ||| -1\n{line}\n")
    with pytest.raises(NBestFormatError) as error:
        read_nbest(path, format="moses")
    assert str(error.value).startswith(f"{tmp_path}/{expected}")


def test_moses_sentences_must_be_contiguous_and_references_long_enough(tmp_path):
    path = tmp_path / "kbest"
    path.write_text("0 ||| a ||| x=1\n1 ||| b ||| x=1\n0 ||| c ||| x=1\n")
    with pytest.raises(NBestFormatError, match=r"kbest:3: field 1 \(id\): sentence 0 appears again"):
        read_nbest(path)
    path.write_text("0 ||| a ||| x=1\n5 ||| b ||| x=1\n")
    (tmp_path / "ref0").write_text("a\nb\n")
    (tmp_path / "ref1").write_text("a\n")
    with pytest.raises(NBestFormatError, match=r"ref0: has 2 lines, entry '5' needs line 6"):
        read_nbest(path, references=[tmp_path / "ref0"])
    with pytest.raises(NBestFormatError, match=r"ref1: has 1 lines, .*ref0 has 2: expected one line per sentence"):
        read_nbest(path, references=[tmp_path / "ref0", tmp_path / "ref1"])


def test_moses_writer_numbers_entries_whose_ids_are_not_numbers(tmp_path):
    write_nbest(sample(("lm",), ids=("utt-a", "utt-b")), tmp_path / "k", "moses")
    assert [e.id for e in read_nbest(tmp_path / "k")] == ["0", "1"]


# --- Kaldi ---


def kaldi_dump(root, ac_cost="utt1-1 120.5\nutt1-2 119.25\nutt2-1 40\n"):
    root.mkdir()
    (root / "text").write_text("utt1-2 the cat sad\nutt1-1 the cat sat\nutt2-1\n")
    (root / "ac_cost").write_text(ac_cost)
    (root / "lm_cost").write_text("utt1-1 10.5\nutt1-2 12\nutt2-1 3\n")
    (root / "text.ref").write_text("utt2 hello\nutt1 the cat sat\n")
    return root


def test_kaldi_reads_costs_ranks_and_references(tmp_path):
    root = kaldi_dump(tmp_path / "nbest")
    assert detect_format(root) == "kaldi"
    nbest = read_nbest(root)
    utt1 = nbest.by_id("utt1")
    assert [(h.rank, h.text) for h in utt1.hypotheses] == [(1, "the cat sat"), (2, "the cat sad")]
    assert utt1.hypotheses[1].features == {"ac_cost": 119.25, "lm_cost": 12.0}
    assert utt1.references == ["the cat sat"] and nbest.by_id("utt2").hypotheses[0].text == ""


@pytest.mark.parametrize(
    ("ac_cost", "expected"),
    [
        ("utt1-1 120.5\nutt1-2 cheap\nutt2-1 40\n", "ac_cost:2: field 2 (cost): expected a finite number, got 'cheap'"),
        ("utt1-1 120.5\nutt1-2 1\nutt3-1 40\n", "ac_cost:3: field 1 (key): 'utt3-1' is not a hypothesis in"),
        ("utt1-1 120.5\nutt1-2 1\n", "text:3: field 1 (key): 'utt2-1' has no line in"),
    ],
)
def test_kaldi_errors_name_line_and_field(tmp_path, ac_cost, expected):
    root = kaldi_dump(tmp_path / "nbest", ac_cost)
    with pytest.raises(NBestFormatError) as error:
        read_nbest(root)
    assert str(error.value).startswith(f"{root}/{expected}")


def test_kaldi_keys_need_a_rank(tmp_path):
    root = kaldi_dump(tmp_path / "nbest")
    (root / "text").write_text("utt1-1 a\nutt1-x b\n")
    with pytest.raises(NBestFormatError, match=r"text:2: field 1 \(key\): expected '<utt-id>-<rank>', got 'utt1-x'"):
        read_nbest(root)


# --- SRILM ---


def test_srilm_three_variants(tmp_path):
    folder = tmp_path / "nbest"
    folder.mkdir()
    (folder / "utt1.score").write_text("-120.5 -10.25 3 the cat sat\n-121 -9 2 the cat\n")
    (folder / "utt2.score").write_text("NBestList1.0\n(-2048) hello world\n(-4096)\n")
    (folder / "utt3.score").write_text(
        "NBestList2.0\n"
        "(-300) hi ( st: 0.00 et: 0.30 g: -100 a: -150 ) h-i ( st: 0.00 et: 0.10 g: 0 a: -1 ) "
        "hi-1 ( st: 0.31 et: 0.32 g: 0 a: -7 ) there ( st: 0.31 et: 0.60 g: -20 a: -30 )\n"
    )
    assert detect_format(folder) == "srilm" and detect_format(folder / "utt3.score") == "srilm"
    nbest = read_nbest(folder)
    assert [e.id for e in nbest] == ["utt1", "utt2", "utt3"]
    assert nbest.entries[0].hypotheses[1] == Hypothesis(
        "the cat", {"acoustic": -121.0, "lm": -9.0, "num_words": 2.0}, 2
    )
    assert [h.text for h in nbest.entries[1].hypotheses] == ["hello world", ""]
    assert nbest.entries[1].hypotheses[0].features == {"score": pytest.approx(-2048 * BYTELOG_TO_LOG10)}
    hyp = nbest.entries[2].hypotheses[0]
    assert hyp.text == "hi there"  # the phone (starts inside "hi") and the HMM state token are not words
    assert hyp.features == pytest.approx(
        {"score": -300 * BYTELOG_TO_LOG10, "acoustic": -180 * BYTELOG_TO_LOG10, "lm": -120 * BYTELOG_TO_LOG10}
    )
    single = read_nbest(folder / "utt1.score")
    assert len(single) == 1 and single.entries[0].id == "utt1"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "-1 -2 x a b\n",
            "u.score:1: field 3 (number of words): expected '<acoustic> <lm> <num-words> words...', got 'x'",
        ),
        ("-1 low 1 a\n", "u.score:1: field 2 (LM score): expected a finite number, got 'low'"),
        ("NBestList1.0\n(-1) a\n(abc) b\n", "u.score:3: field 1 (score): expected a finite number, got 'abc'"),
        (
            "NBestList2.0\n(-1) a ( st: 0 et: 1 g: 0 a: 0\n",
            "u.score:2: field 2 (info of 'a'): expected 'a ( st: <start>",
        ),
        (
            "NBestList2.0\n(-1) a ( st: 0 et: 1 g: x a: 0 )\n",
            "u.score:2: field 2 (info of 'a') 'g:': expected a finite number, got 'x'",
        ),
    ],
)
def test_srilm_errors_name_line_and_field(tmp_path, text, expected):
    (tmp_path / "u.score").write_text(text)
    with pytest.raises(NBestFormatError) as error:
        read_nbest(tmp_path / "u.score", format="srilm")
    assert str(error.value).startswith(f"{tmp_path}/{expected}")


def test_srilm_writer_needs_acoustic_and_lm(tmp_path):
    with pytest.raises(ValueError, match="needs an 'acoustic' feature"):
        write_nbest(sample(("score",)), tmp_path / "s", "srilm")


# --- JSONL ---


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"id": 3, "hypotheses": []}', "l.jsonl:2: field 'id': expected a string, got 3"),
        (
            '{"id": "a", "hypotheses": [{"text": "x", "features": {"lm": "bad"}}]}',
            "l.jsonl:2: field 'hypotheses[0].features.lm': expected a finite number",
        ),
        (
            '{"id": "a", "hypotheses": [{"txt": "x"}]}',
            "l.jsonl:2: field 'hypotheses[0]': expected an object with 'text', got {'txt': 'x'}",
        ),
        (
            '{"id": "a", "hypotheses": [], "references": "r"}',
            "l.jsonl:2: field 'references': expected a list of strings",
        ),
        (
            '{"id": "a", "hypotheses": [{"text": "x", "rank": true}]}',
            "l.jsonl:2: field 'hypotheses[0].rank': expected an integer",
        ),
        ('{"id": "a", "hypotheses": [}', "l.jsonl:2: column 28: not valid JSON"),
        ('{"id": "", "hypotheses": [{"text": "x"}]}', "l.jsonl:2: id '' is empty; expected an id for every entry"),
        ('{"id": "ok", "hypotheses": [{"text": "y"}]}', "l.jsonl:2: id 'ok' appears twice (first at "),
    ],
)
def test_jsonl_errors_name_line_and_field(tmp_path, line, expected):
    path = tmp_path / "l.jsonl"
    path.write_text('{"id": "ok", "hypotheses": [{"text": "x"}]}\n' + line + "\n")
    with pytest.raises(NBestFormatError) as error:
        read_nbest(path)
    assert str(error.value).startswith(f"{tmp_path}/{expected}")


# --- the registry ---


def test_detection_and_override(tmp_path):
    path = tmp_path / "list.txt"
    write_nbest(ROUND_TRIPS["jsonl"], path, "jsonl")
    with pytest.raises(NBestFormatError, match=r"list.txt: cannot tell its n-best format; expected one of espnet, "):
        detect_format(path)
    assert read_nbest(path, format="jsonl").entries == ROUND_TRIPS["jsonl"].entries
    moses_file = tmp_path / "kbest.json"  # a name that says HyPoradise, content that is Moses
    moses_file.write_text(JOSHUA)
    assert detect_format(moses_file) == "moses" and len(read_nbest(moses_file)) == 2
    with pytest.raises(ValueError, match="unknown n-best format 'nbest'; expected one of"):
        read_nbest(moses_file, format="nbest")
    with pytest.raises(FileNotFoundError):
        detect_format(tmp_path / "missing")
    # in the order detection tries them: wmt before srilm (a folder of plain lines), fairseq before moses
    assert list(FORMATS) == ["espnet", "kaldi", "wmt", "hyporadise", "jsonl", "fairseq", "moses", "srilm"]


def test_a_gzipped_jsonl_list_is_read_and_an_unknown_format_names_the_flag(tmp_path, capsys):
    line = json.dumps({"id": "a", "hypotheses": [{"text": "x y"}], "references": ["x y"]}) + "\n"
    (tmp_path / "l.jsonl.gz").write_bytes(gzip.compress(line.encode()))
    assert detect_format(tmp_path / "l.jsonl.gz") == "jsonl"
    assert read_nbest(tmp_path / "l.jsonl.gz").entries[0].references == ["x y"]
    (tmp_path / "l.txt.gz").write_bytes(gzip.compress(line.encode()))
    with pytest.raises(NBestFormatError, match="say which with --format") as error:
        detect_format(tmp_path / "l.txt.gz")
    assert "format=" not in str(error.value)
    assert rescore_main(["references", str(tmp_path / "l.txt.gz"), "--out", str(tmp_path / "r.txt")]) == 2
    assert "say which with --format" in capsys.readouterr().err


def test_conversion_between_formats(tmp_path):
    path = tmp_path / "output.gold"
    path.write_text(JOSHUA)
    moses = read_nbest(path)
    write_nbest(moses, tmp_path / "k.jsonl", "jsonl")
    assert read_nbest(tmp_path / "k.jsonl").entries == moses.entries
    espnet = read_nbest(espnet_dump(tmp_path / "dev"))
    write_nbest(espnet, tmp_path / "dev.jsonl", "jsonl")
    assert read_nbest(tmp_path / "dev.jsonl").entries == espnet.entries
