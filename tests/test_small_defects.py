"""The small defects of issue 34, each reproduced here (``lm-serve client rescore --feature-default``: in
test_server.py): an empty config left an empty ``--out`` folder behind, a bundle error named ``size`` for
``vocab.size``, an undetected gzipped JSONL list's hint named Python's ``format=`` instead of ``--format``, and
``admin = true`` on a non-loopback address without client certificates started without a warning."""

import json
import subprocess
from pathlib import Path

import pytest

from lmserve.core.bundle import Bundle, BundleError
from lmserve.rescoring.commands.cli import main as rescore_main
from lmserve.rescoring.nbest import NBestFormatError, detect_format, read_nbest
from lmserve.server.app import admin_exposure
from lmserve.server.config import load_config
from lmserve.training.cli import main as train_main


def test_a_config_that_fails_leaves_no_run_folder(tmp_path, capsys):
    (tmp_path / "empty.toml").write_text("")
    assert train_main(["fit", str(tmp_path / "empty.toml"), "--out", str(tmp_path / "run")]) == 2
    assert "data.train and data.valid must both be set" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    (tmp_path / "run").mkdir()  # a folder that was there before stays
    assert train_main(["fit", str(tmp_path / "empty.toml"), "--out", str(tmp_path / "run")]) == 2
    assert (tmp_path / "run").is_dir()


@pytest.mark.parametrize(("section", "field"), [("vocab", "size"), ("model", "layers"), ("model", "hidden_size")])
def test_a_bundle_error_names_the_whole_field(tmp_path, bundles, section, field):
    bundle = tmp_path / "bundle"
    subprocess.run(["cp", "-r", str(bundles[("full", 0.0)][1]), str(bundle)], check=True)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest[section][field] = 0
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=rf"field '{section}\.{field}' = 0: expected a positive integer"):
        Bundle.load(bundle)


def test_a_gzipped_jsonl_list_is_read_and_an_unknown_format_names_the_flag(tmp_path, capsys):
    import gzip

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


def config(tmp_path: Path, admin: bool, tls: str = "") -> Path:
    path = tmp_path / "serve.toml"
    path.write_text(f'[server]\nadmin = {str(admin).lower()}\n{tls}\n[models.m]\nbundle = "b"\n')
    return load_config(path)


@pytest.mark.parametrize(
    ("host", "admin", "tls", "warned"),
    [
        ("0.0.0.0", True, "", "without TLS"),
        ("10.1.2.3", True, '[tls]\ncert = "c"\nkey = "k"\n', "with TLS but no client_ca"),
        ("::", True, "", "without TLS"),
        ("0.0.0.0", True, '[tls]\ncert = "c"\nkey = "k"\nclient_ca = "ca"\n', None),
        ("127.0.0.1", True, "", None),
        ("::1", True, "", None),
        ("localhost", True, "", None),
        ("0.0.0.0", False, "", None),
    ],
)
def test_an_admin_service_open_to_the_network_is_warned_about(tmp_path, host, admin, tls, warned):
    message = admin_exposure(config(tmp_path, admin, tls), host)
    if warned is None:
        assert message is None
    else:
        assert f"admin = true on {host}, {warned}: anyone who reaches the port can reload the models" in message
