"""The test tiers (tests/support/tiers.py): each test CI leaves out names CI tests that still
prove its path, and the conftest's matching of node ids to keys."""

import re
from pathlib import Path

from tests.conftest import extended_key
from tests.support.tiers import EXTENDED


def test_every_extended_test_names_a_ci_test_that_covers_its_path():
    """A cover text names tests as ``module::name`` (or ``module::name[param]``); each must be
    a test of that module, and at least one must stay in CI (not be a key of EXTENDED itself)."""
    lacking, missing = [], []
    for key, cover in EXTENDED.items():
        named = re.findall(r"(test_\w+)::(test_\w+)(\[[^\]]*\])?", cover)
        missing += [f"{m}::{n}" for m, n, _ in named
                    if f"def {n}(" not in (Path(__file__).parent / f"{m}.py").read_text()]
        in_ci = [f"{m}::{n}" for m, n, p in named
                 if extended_key(f"tests/{m}.py::{n}{p.replace('|', '')}") is None]
        if not in_ci:
            lacking.append(key)
    assert not missing, f"named in tests/support/tiers.py but not a test: {missing}"
    assert not lacking, f"no CI test named for: {lacking}"


def test_a_key_without_parameters_takes_every_parameter():
    key = next(k for k in EXTENDED if "[" not in k)
    assert extended_key(key) == key and extended_key(key + "[any]") == key
    assert extended_key(key + "_other") is None and extended_key("tests/test_nothing.py::test_x") is None
    with_param = next(k for k in EXTENDED if "[" in k)
    assert extended_key(with_param) == with_param
    assert extended_key(with_param.split("[")[0] + "[another]") is None
