"""Benchmark commands as the docs write them, from the repository root: a relative ``--bundle`` or ``--ngram`` means
the current directory's, also where a benchmark writes a server config into a temporary folder (a relative path
there was resolved against that folder, and the documented command failed as written)."""

import pytest

from benchmarks import beam_step_load, state_cache_soak


class Started(Exception):
    """Raised by the stand-in server: the config was written, nothing needs to run."""


@pytest.mark.parametrize("module", [beam_step_load, state_cache_soak])
def test_relative_model_paths_reach_the_server_config_as_the_current_directorys(module, tmp_path, monkeypatch):
    configs = []

    def server(config, log, **kwargs):
        configs.append(config.read_text())
        raise Started

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(module, "walk_inputs", lambda args: (None, [["w1"]], ["w1"], args.ngram))
    monkeypatch.setattr(module, "ServerProcess", server)
    with pytest.raises(Started):
        module.main(["--bundle", "var/bundles/demo", "--ngram", "var/ngrams/demo_atis_4gram.bin", "--no-write"])
    assert f'bundle = "{tmp_path / "var" / "bundles" / "demo"}"' in configs[0]
    assert f'ngram = "{tmp_path / "var" / "ngrams" / "demo_atis_4gram.bin"}"' in configs[0]
