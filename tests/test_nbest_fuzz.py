"""Every n-best reader and writer on lists drawn by hypothesis (tests/nbest_fuzz.py): the same drawn lists, as each
format holds them, come back unchanged from a write and a read; and a malformed file is a clean error naming the file,
or a list that round-trips, never a traceback or a partial output. A few cases per format here, to stay fast (the
retired benchmarks/rescore_robustness.py ran 1,000 per format: docs/benchmarks/robustness.md)."""

import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from nbest_fuzz import CASES, FILE_NAMES, as_format, check, content, general_lists, mutate, mutations, seed_files

from lmserve.rescoring.nbest import FORMATS, read_nbest, write_nbest

pytestmark = pytest.mark.slow  # hundreds of fuzzed files a format


@settings(max_examples=60, deadline=None)
@given(general=general_lists())
def test_every_format_gives_back_the_lists_it_holds(general):
    with tempfile.TemporaryDirectory() as tmp:
        for format in FORMATS:
            nbest = as_format(general, format)
            path = Path(tmp) / format / FILE_NAMES.get(format, "dump")
            write_nbest(nbest, path, format)
            assert content(read_nbest(path, format)) == content(nbest), format


@pytest.mark.parametrize("case", CASES)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutation=mutations())
def test_a_malformed_file_is_a_clean_error_or_a_list_that_round_trips(case, mutation):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        path = seed_files(case, root / "in")
        what = mutate(path, mutation)
        (root / "out").mkdir()
        try:
            check(case, path, root / "out")
        except Exception as e:  # (a reader's traceback is the failure: say which file did it)
            raise AssertionError(f"{case}, {what}: {type(e).__name__}: {e}") from e


@pytest.mark.parametrize("case", CASES)
def test_the_unmutated_lists_round_trip(case, tmp_path):
    path = seed_files(case, tmp_path / "in")
    (tmp_path / "out").mkdir()
    assert check(case, path, tmp_path / "out") == "round trip"
