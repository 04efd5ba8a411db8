"""`megatron-grpo serve` command line: defaults and one-line errors."""

import pytest

from megatron_grpo.cli import main as cli_main
from megatron_grpo.rollout.serve import main, parse_args


def test_binds_loopback_by_default():
    args = parse_args(["--model-dir", "m"])
    assert (args.host, args.port, args.api_key, args.dtype) == ("127.0.0.1", 30000, None, "auto")


def test_not_a_model_directory_is_a_one_line_error(tmp_path, capsys):
    assert main(["--model-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(tmp_path) in err and "config.json" in err


def test_registered_as_a_subcommand(tmp_path, capsys):
    assert cli_main(["serve", "--model-dir", str(tmp_path)]) == 2
    with pytest.raises(SystemExit) as info:
        cli_main(["serve", "--help"])
    assert info.value.code == 0
    assert "--api-key" in capsys.readouterr().out
