"""`megatron-grpo serve` command line: defaults and one-line errors."""

import pytest

from megatron_grpo.cli import main as cli_main
from megatron_grpo.inference.serve import main, parse_args


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


class _Started(Exception):
    """Raised in place of loading the model: the server got past its start-up checks."""


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    import megatron_grpo.inference.serve as serve
    from megatron_grpo.generation.adapters.embedded import API_KEY_ENV

    def engine(*args, **kwargs):
        raise _Started

    monkeypatch.setattr(serve, "EmbeddedEngine", engine)
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "node7.cluster"])
def test_a_network_address_without_an_api_key_is_refused(model_dir, host, capsys):
    """An open server on the network would let anyone generate, load weights or join the
    weight-update group: refused at start-up, before the model loads, saying how to give a key."""
    assert cli_main(["serve", "--model-dir", model_dir, "--host", host]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"--host {host}" in err and "--api-key" in err and "MEGATRON_GRPO_API_KEY" in err


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
def test_loopback_without_an_api_key_still_starts(model_dir, host):
    with pytest.raises(_Started):
        main(["--model-dir", model_dir, "--host", host])


def test_a_network_address_with_an_api_key_starts(model_dir, monkeypatch):
    with pytest.raises(_Started):
        main(["--model-dir", model_dir, "--host", "0.0.0.0", "--api-key", "k"])
    monkeypatch.setenv("MEGATRON_GRPO_API_KEY", "k")
    with pytest.raises(_Started):
        main(["--model-dir", model_dir, "--host", "0.0.0.0"])
