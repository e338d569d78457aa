"""lm-train's and lm-serve's configs are read by one helper (lmserve/core/tomlconfig.py): both raise the same
ConfigError, naming the file and the key, for an unknown key and for a wrong type."""

import re

import pytest

from lmserve.core.tomlconfig import ConfigError, check_value, parse_override, read_toml
from lmserve.server import config as server_config
from lmserve.training import config as training_config

TRAINING = "[model]\nhidden_size = 8\n"
SERVING = '[server]\nworkers = 1\n[models.m]\nbundle = "b"\n'


@pytest.mark.parametrize(
    ("load", "base", "before", "after", "message"),
    [
        (training_config.load_config, TRAINING, "hidden_size = 8", "hiden_size = 8", "unknown key model.hiden_size; "),
        (server_config.load_config, SERVING, "workers = 1", "wrokers = 1", "unknown key server.wrokers; "),
        (server_config.load_config, SERVING, 'bundle = "b"', 'bundel = "b"', "unknown key models.m.bundel; "),
        (training_config.load_config, TRAINING, "= 8", '= "8"', "model.hidden_size = '8': expected an integer"),
        (server_config.load_config, SERVING, "= 1", '= "1"', "server.workers = '1': expected an integer"),
        (server_config.load_config, SERVING, '= "b"', "= 1", "models.m.bundle = 1: expected a string"),
    ],
)
def test_both_parts_raise_one_config_error_naming_the_file_and_key(tmp_path, load, base, before, after, message):
    assert training_config.ConfigError is server_config.ConfigError is ConfigError
    path = tmp_path / "bad.toml"
    path.write_text(base.replace(before, after))
    with pytest.raises(ConfigError) as info:
        load(path)
    assert str(info.value).startswith(f"{path}: ") and message in str(info.value)
    if "unknown" in message:
        assert "expected one of " in str(info.value)


@pytest.mark.parametrize("load", [training_config.load_config, server_config.load_config])
def test_a_file_that_is_not_toml_is_named_with_its_line(tmp_path, load):
    path = tmp_path / "bad.toml"
    path.write_text("# fine\n[server\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}:2: not valid TOML: "):
        load(path)
    with pytest.raises(ConfigError, match="config file not found"):
        load(tmp_path / "missing.toml")


def test_values_and_overrides():
    assert check_value(3, float, "x") == 3.0 and isinstance(check_value(3, float, "x"), float)
    assert check_value({"a": "f"}, dict[str, str], "t") == {"a": "f"}
    with pytest.raises(ConfigError, match=r"^t\.a = 1: expected a string$"):
        check_value({"a": 1}, dict[str, str], "t")
    with pytest.raises(ConfigError, match=r"^l\[1\] = True: expected an integer$"):
        check_value([1, True], list[int], "l")
    assert parse_override("optimizer.lr=0.5") == ("optimizer", "lr", 0.5)
    assert parse_override("data.valid=b.txt") == ("data", "valid", "b.txt")  # not TOML: a bare string
    for bad in ("model.hidden_size", "lr=1", "a.b.c=1", ".lr=1"):
        with pytest.raises(ConfigError, match="expected section.key=value"):
            parse_override(bad)


def test_read_toml_reads_tables(tmp_path):
    (tmp_path / "c.toml").write_text("[a]\nb = 1\n")
    assert read_toml(tmp_path / "c.toml") == {"a": {"b": 1}}
