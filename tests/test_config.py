from pathlib import Path

import pytest

from lmserve.training.config import ConfigError, config_from_dict, expand_data_path, load_config, parse_override


def write(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_defaults_file_and_overrides_combine(tmp_path):
    path = write(tmp_path, '[data]\ntrain = "a.txt"\nmode = "sentence"\n[model]\nhidden_size = 64\n')
    cfg = load_config(
        path,
        [
            "model.hidden_size=32",
            "optimizer.lr=0.5",
            "head.cutoffs=[100, 1000]",
            "model.tie_embeddings=true",
            "data.valid=b.txt",
        ],
    )
    assert cfg.data.mode == "sentence"
    assert cfg.model.hidden_size == 32
    assert cfg.optimizer.lr == 0.5
    assert cfg.head.cutoffs == [100, 1000]
    assert cfg.model.tie_embeddings is True
    assert cfg.data.valid == "b.txt"  # not TOML, taken as a bare string
    assert cfg.model.layers == 2  # default kept


def test_int_accepted_where_a_float_is_expected(tmp_path):
    cfg = load_config(write(tmp_path, "[optimizer]\nlr = 1\n"))
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)


@pytest.mark.parametrize(
    ("text", "overrides", "message"),
    [
        ("[model]\nhiden_size = 3\n", [], "unknown key model.hiden_size"),
        ("[modle]\n", [], "unknown section [modle]"),
        ("[model]\nhidden_size = 'big'\n", [], "model.hidden_size = 'big': expected an integer"),
        ("[data]\nmode = 'bptt'\n", [], "data.mode = 'bptt', expected one of stream, sentence"),
        ("[model]\nlayers = 2\n", ["model.layers=2.5"], "model.layers = 2.5: expected an integer"),
        ("[model]\ntie_embeddings = 1\n", [], "model.tie_embeddings = 1: expected true or false"),
        ("[model\n", [], "not valid TOML"),
        ("[train]\ndevice = 'gpu'\n", [], "train.device = 'gpu', expected cpu, cuda or cuda:N"),
    ],
)
def test_errors_name_the_file_and_key(tmp_path, text, overrides, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    assert message in str(info.value)
    if "TOML" not in message:
        assert str(path) in str(info.value)


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="expected section.key=value"):
        parse_override("model.hidden_size")
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(None, ["lr=1"])


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")


def test_shipped_configs_load():
    """Training configs; the *.rows.toml files list benchmark runs (test_objectives_sampled checks every row), the
    serve_*.toml files are lm-serve's (test_server_ops checks them)."""
    configs = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.toml"))
    configs = [path for path in configs if not path.name.endswith(".rows.toml") and not path.name.startswith("serve_")]
    assert configs
    for path in configs:
        load_config(path)


def test_the_data_folder_comes_from_lmserve_data_or_the_current_directory(tmp_path, monkeypatch):
    """Never from where the package lies: an installed lm-train must not look beside site-packages."""
    monkeypatch.setenv("LMSERVE_DATA", str(tmp_path))
    assert expand_data_path("{data}/ptb/train.txt") == f"{tmp_path}/ptb/train.txt"
    assert expand_data_path("plain.txt") == "plain.txt"
    monkeypatch.setenv("LMSERVE_DATA", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match=r"LMSERVE_DATA = .*missing, which does not exist: set LMSERVE_DATA=DIR or"):
        expand_data_path("{data}/x.txt")
    monkeypatch.delenv("LMSERVE_DATA")
    (tmp_path / "shared" / "data").mkdir(parents=True)
    (tmp_path / "checkout").mkdir()
    monkeypatch.chdir(tmp_path / "checkout")  # a source checkout's root, where make and CI run
    assert expand_data_path("{data}/x.txt") == str(Path("../shared/data/x.txt"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"\.\./shared/data \(from .*\), which does not exist"):
        expand_data_path("{data}/x.txt")


def test_head_and_objective_keys_are_checked_at_start_up():
    for raw, key in (
        ({"head": {"type": "dsoftmax"}}, "needs head.cutoffs"),
        ({"head": {"type": "full", "band_widths": [4]}}, "head.band_widths is for head.type = dsoftmax"),
        ({"head": {"type": "full", "slim_embeddings": "run"}}, "head.slim_embeddings is for head.type = slim"),
        ({"head": {"type": "dsoftmax", "band_layout": "x"}}, "head.band_layout"),
        ({"head": {"type": "cnnsoftmax", "correction_size": -1}}, "head.correction_size = -1"),
        ({"objective": {"type": "adaptive_importance_sampling", "adapt_rate": 1.5}}, "objective.adapt_rate = 1.5"),
        ({"head": {"type": "adaptive"}, "objective": {"type": "target_sampling"}}, "needs head.type = full"),
    ):
        with pytest.raises(ConfigError, match=key):
            config_from_dict(raw)
    config_from_dict({"head": {"type": "dsoftmax", "cutoffs": [10], "band_widths": [150, 50]}})


def test_old_key_names_are_read_under_their_new_ones(tmp_path, capsys):
    """[model] slim_subvectors / slim_pool became input_slim_subvectors / input_slim_pool (head.slim_* are the output
    layer's): saved configs are read silently, a file or --set that gives an old name is warned."""
    cfg = config_from_dict({"model": {"slim_subvectors": 4, "slim_pool": 40}})
    assert (cfg.model.input_slim_subvectors, cfg.model.input_slim_pool) == (4, 40)
    assert "slim_pool" not in cfg.to_dict()["model"] and cfg.to_dict()["model"]["input_slim_pool"] == 40
    assert capsys.readouterr().err == ""
    cfg = load_config(write(tmp_path, "[model]\nslim_pool = 40\nslim_subvectors = 4\n"), ["model.slim_pool=80"])
    assert (cfg.model.input_slim_subvectors, cfg.model.input_slim_pool) == (4, 80)  # the --set wins, as it would
    err = capsys.readouterr().err
    assert "model.slim_subvectors is the old name of model.input_slim_subvectors" in err and "--set" in err
    with pytest.raises(ConfigError, match="model.slim_pool is the old name of model.input_slim_pool: give one"):
        config_from_dict({"model": {"slim_pool": 40, "input_slim_pool": 40}})
