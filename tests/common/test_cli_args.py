"""common/cli_args.py: the range checks every CLI shares refuse NaN (which compares False
with every bound) and, where asked, inf; output paths are checked before any work."""
from __future__ import annotations

import argparse
import math

import pytest

from eagle_deploy.common.cli_args import check_at_least, check_output_path, number_list


@pytest.mark.parametrize("value, finite, message", [
    (math.nan, False, "--lr must be a finite number >= 0, got nan"),
    (math.nan, True, "--lr must be a finite number >= 0, got nan"),
    (math.inf, True, "--lr must be a finite number >= 0, got inf"),
    (-math.inf, False, "--lr must be >= 0, got -inf"),
    (-0.5, True, "--lr must be >= 0, got -0.5"),
])
def test_check_at_least_refuses_nan_and_inf(value, finite, message):
    with pytest.raises(ValueError) as err:
        check_at_least([("--threads", 2, 1), ("--lr", value, 0)], finite=finite)
    assert str(err.value) == message


def test_check_at_least_passes_values_in_range():
    check_at_least([("--lr", 0.0, 0), ("--threads", None, 1), ("--limit", 10**400, 0)], finite=True)
    check_at_least([("--rate", math.inf, 0)])  # inf unless a finite number is asked for (a rate: all at once)


@pytest.mark.parametrize("text, message", [("0,nan", "temperatures must be finite numbers >= 0, got '0,nan'"),
                                           ("inf", "temperatures must be finite numbers >= 0, got 'inf'"),
                                           ("-1", "temperatures must be >= 0, got '-1'")])
def test_number_list_refuses_nan_and_inf(text, message):
    with pytest.raises(argparse.ArgumentTypeError) as err:
        number_list(float, 0, "temperatures")(text)
    assert str(err.value) == message
    assert number_list(float, 0, "temperatures")("0,0.7") == [0.0, 0.7]
    assert number_list(int, 0, "layers")("1,2") == [1, 2]


def test_check_output_path(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    check_output_path("--out", tmp_path / "new" / "deeper", folder=True)  # created by the writer
    check_output_path("--json", tmp_path / "new" / "x.json", folder=False)
    check_output_path("--out", None, folder=True)
    deep = afile / "a" / "b"
    for path, folder, message in ((afile, True, f"--x {afile} is a file, not a folder"),
                                  (tmp_path, False, f"--x {tmp_path} is a folder, not a file"),
                                  (deep, True, f"--x {deep}: {afile} is a file, not a folder")):
        with pytest.raises(ValueError) as err:
            check_output_path("--x", path, folder)
        assert str(err.value) == message
