"""lm-train prepare: the same ids as reading the text, bounded memory, idempotence, errors that name the file."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, make_sentences, tiny_config_text, write_corpus

from lmserve.training.cli import main
from lmserve.training.corpus import CorpusError, encode_file, read_sentences
from lmserve.training.prepared import PreparedDataError, PreparedDataset, VocabSettings, open_corpus, prepare
from lmserve.training.vocab import Vocabulary


@pytest.fixture
def texts(tmp_path):
    """Two gzipped training files (one without a final newline, one with an empty line and CRLF), valid and test."""
    train = make_sentences(400, seed=1)
    write_corpus(tmp_path / "a.txt.gz", train[:250])
    (tmp_path / "b.txt").write_bytes(("\r\n".join(train[250:300] + [""] + train[300:]) + " w3\u00a0w4").encode())
    return {
        "train": [tmp_path / "a.txt.gz", tmp_path / "b.txt"],
        "valid": [write_corpus(tmp_path / "valid.txt", make_sentences(40, seed=2) + ["w1 neverseen w2"])],
        "test": [write_corpus(tmp_path / "test.txt", make_sentences(40, seed=3))],
    }


@pytest.mark.parametrize("workers", [0, 2])
def test_prepared_ids_and_vocabulary_are_those_of_the_text(tmp_path, texts, workers):
    out = tmp_path / "prep"
    # blocks of 512 bytes: many block boundaries, lines never cut
    manifest = prepare(texts, out, VocabSettings(max_size=30), workers=workers, block_bytes=512)
    sentences = [s for path in texts["train"] for s in read_sentences(path)]
    expected = Vocabulary.build(sentences, max_size=30)
    data = PreparedDataset(out)
    assert data.vocab.tokens == expected.tokens and data.vocab.counts == expected.counts
    assert data.dtype == np.dtype("<u2") and manifest["dtype"] == "<u2"
    train = data.split("train")
    assert isinstance(train.ids, np.memmap)
    assert [list(train.sentence(i)) for i in range(train.num_sentences)] == [
        [expected.index.get(w, 0) for w in s] for s in sentences
    ]
    assert sentences[-1][-2:] == ["w3", "w4"]  # a no-break space separates words, as str.split() has it
    for split in ("valid", "test"):
        text = encode_file(texts[split][0], expected)
        prepared = data.split(split)
        np.testing.assert_array_equal(prepared.ids, text.ids)
        np.testing.assert_array_equal(prepared.offsets, text.offsets)
        assert prepared.oov == text.oov == manifest["splits"][split]["oov"]
    assert manifest["splits"]["train"]["words"] == sum(len(s) for s in sentences)
    assert {f["path"] for f in manifest["splits"]["train"]["inputs"]} == {str(p.resolve()) for p in texts["train"]}


def test_a_vocabulary_over_65536_words_is_stored_as_uint32(tmp_path):
    path = tmp_path / "big.txt"
    path.write_text("\n".join(" ".join(f"x{i}" for i in range(j, j + 1000)) for j in range(0, 70000, 1000)) + "\n")
    prepare({"train": [path]}, tmp_path / "prep", workers=0)
    data = PreparedDataset(tmp_path / "prep")
    assert data.dtype == np.dtype("<u4") and len(data.vocab) == 70003
    assert data.vocab.tokens[int(data.split("train").ids[-1])] == "x69999"


def test_a_second_run_on_unchanged_inputs_does_nothing(tmp_path, texts, capsys):
    out = tmp_path / "prep"
    prepare(texts, out, workers=0)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    prepare(texts, out, workers=0)
    assert "up to date" in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    prepare(texts, out, VocabSettings(min_count=2), workers=0)  # other settings: made again
    assert PreparedDataset(out).manifest["vocab"]["settings"]["min_count"] == 2
    texts["test"][0].write_text("w1 w2\n")  # changed input: made again
    prepare(texts, out, VocabSettings(min_count=2), workers=0)
    assert PreparedDataset(out).split("test").num_words == 2
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary left


@pytest.mark.slow  # millions of tokens, or training
def test_memory_stays_bounded_whatever_the_corpus_size(tmp_path):
    """4M tokens (as Python objects about 180 MB) prepared by 2 workers in blocks of 256 kB: the main process and
    each worker stay far below what holding the corpus would take."""
    rng = np.random.default_rng(0)
    words = np.array([f"w{i}" for i in range(5000)])
    path = tmp_path / "big.txt"
    with path.open("w") as f:
        for _ in range(20):
            ids = rng.zipf(1.3, size=200_000) % 5000
            f.write("\n".join(" ".join(line) for line in np.split(words[ids], 10_000)) + "\n")
    # the main process's peak from /proc (getrusage's would include the pytest process that started it), the
    # workers' from getrusage (they fork from the small main process)
    script = (
        "import resource, re; from lmserve.training.prepared import prepare; "
        f"prepare({{'train': [{str(path)!r}]}}, {str(tmp_path / 'prep')!r}, workers=2, block_bytes=1 << 18); "
        "print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1], "
        "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True)
    main_kb, worker_kb = map(int, out.stdout.split())
    assert main_kb < 120_000 and worker_kb < 120_000, (main_kb, worker_kb)
    assert PreparedDataset(tmp_path / "prep").split("train").num_words == 4_000_000


def test_text_errors_name_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"a b\n" * 300 + b"c \xff d\n")
    with pytest.raises(CorpusError, match=r"bad.txt:301: not valid UTF-8"):
        prepare({"train": [bad]}, tmp_path / "p1", workers=2, block_bytes=256)
    empty = tmp_path / "empty.txt.gz"
    empty.write_bytes(gzip.compress(b""))
    with pytest.raises(CorpusError, match=r"empty.txt.gz: empty file"):
        prepare({"train": [empty]}, tmp_path / "p2", workers=0)
    with pytest.raises(CorpusError, match=r"nope.txt: file not found"):
        prepare({"train": [tmp_path / "nope.txt"]}, tmp_path / "p3", workers=0)
    assert not any((tmp_path / p).exists() for p in ("p1", "p2", "p3"))


def test_dataset_errors_name_the_file(tmp_path, texts):
    out = tmp_path / "prep"
    prepare(texts, out, workers=0)
    ids = out / "train.ids.bin"
    original = ids.read_bytes()
    ids.write_bytes(original[:-2])
    with pytest.raises(PreparedDataError, match=r"train.ids.bin: \d+ bytes, the manifest says \d+ \(truncated"):
        PreparedDataset(out)
    ids.write_bytes(bytes([original[0] ^ 1]) + original[1:])
    with pytest.raises(PreparedDataError, match=r"train.ids.bin: sha256 .* does not match"):
        PreparedDataset(out)
    ids.write_bytes(original)
    other = Vocabulary.build([["a", "b"]])
    with pytest.raises(PreparedDataError, match=r"vocab.tsv: vocabulary mismatch"):
        open_corpus(str(out), "valid", other, lowercase=False)
    with pytest.raises(PreparedDataError, match=r"has no 'dev' split"):
        open_corpus(f"{out}:dev", "valid", None, lowercase=False)
    (out / "manifest.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(PreparedDataError, match=r"manifest.json: format is 'something else'"):
        PreparedDataset(out)


@pytest.mark.slow  # millions of tokens, or training
@pytest.mark.parametrize("mode", ["stream", "sentence"])
def test_fit_and_eval_read_a_prepared_dataset_like_the_text(tmp_path, texts, mode, capsys):
    prepared = tmp_path / "prep"
    args = ["--train", str(texts["train"][0]), "--valid", str(texts["valid"][0]), "--test", str(texts["test"][0])]
    assert main(["prepare", "--out", str(prepared), *args, "--max-size", "30", "--workers", "2"]) == 0
    from_text = {"train": texts["train"][0], "valid": texts["valid"][0], "test": texts["test"][0]}
    results = {}
    for name, corpus, vocab in (
        ("text", from_text, {"max_size": 30}),
        ("prepared", {"train": prepared, "valid": prepared, "test": f"{prepared}:test"}, {}),
    ):
        config = tmp_path / f"{name}.toml"
        config.write_text(tiny_config_text(corpus, mode, "full", vocab=vocab, train={"epochs": 1}))
        assert main(["fit", str(config), "--out", str(tmp_path / name)]) == 0
        results[name] = json.loads((tmp_path / name / "results.json").read_text())
    for split in ("valid", "test"):  # the same model trained on the same ids, read from memory maps
        assert results["prepared"][split]["ppl"] == pytest.approx(results["text"][split]["ppl"], rel=1e-9)
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(tmp_path / "prepared"), "--file", f"{prepared}:valid"]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    assert evaluated["ppl"] == pytest.approx(results["prepared"]["valid"]["ppl"], rel=1e-6)
    assert (tmp_path / "text" / "data" / "manifest.json").exists()  # text goes through prepare, into the run
