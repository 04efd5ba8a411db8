"""Server management: launch, log, death detection (in flight and idle), restart, stop."""

import os
import signal
import time

import psutil
import pytest

from megatron_grpo.generation import RolloutClient, RolloutError, SamplingParams
from megatron_grpo.generation.manager import RolloutServerManager, free_port
from tools.tiny import save_tiny_model
from megatron_grpo.config import EngineConfig
from tests.support.configs import experiment


@pytest.mark.slow
def test_killed_engine_is_detected_and_restarted(tmp_path):
    model_dir = save_tiny_model(tmp_path / "qwen2", "qwen2")
    cfg = experiment(engine=EngineConfig(api_key="k", max_restarts=1, launch_timeout_s=120, request_timeout_s=5,
                                         max_retries=2))
    manager = RolloutServerManager(cfg, model_dir=str(model_dir), run_dir=tmp_path / "run")
    (url,) = manager.start()
    client = RolloutClient.from_config(cfg.engine, [url])
    try:
        assert len(client.generate([[5, 6]], 2, SamplingParams(max_new_tokens=3))) == 2
        # the key is enforced (the client sends it) but never on the engine's command line
        assert "k" not in psutil.Process(manager.pid).cmdline()
        assert "--api-key" not in manager.log_path.read_text()
        with pytest.raises(RolloutError, match="401"):
            RolloutClient([url], max_retries=1).generate([[5, 6]], 1, SamplingParams(max_new_tokens=1))

        # Killed while a long generation is in flight: a clear error within the timeout, no hang.
        long = SamplingParams(max_new_tokens=480, ignore_eos=True)
        future = client.submit(client.aio.generate([[5, 6, 7]] * 8, 8, long))
        time.sleep(1.0)
        os.kill(manager.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(RolloutError, match=url):
            future.result(timeout=60)
        assert time.monotonic() - started < cfg.engine.request_timeout_s * cfg.engine.max_retries + 5
        assert not manager.alive()

        assert manager.ensure_alive() is True  # restarted on the same port
        assert manager.urls == [url] and manager.restarts == 1
        assert len(client.generate([[5, 6]], 1, SamplingParams(max_new_tokens=3))) == 1
        assert manager.ensure_alive() is False

        os.kill(manager.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30  # a loaded machine delivers the kill late (0.5 s fixed once missed it)
        while manager.alive():
            assert time.monotonic() < deadline, "the killed engine still runs"
            time.sleep(0.05)
        with pytest.raises(RolloutError, match="max_restarts=1"):
            manager.ensure_alive()
    finally:
        client.close()
        manager.stop()


@pytest.mark.slow
def test_stop_ends_only_its_own_process_group(tmp_path):
    model_dir = save_tiny_model(tmp_path / "qwen2", "qwen2")
    manager = RolloutServerManager(experiment(engine=EngineConfig(launch_timeout_s=120)), model_dir=str(model_dir),
                                   run_dir=tmp_path)
    manager.start()
    pid = manager.pid
    assert os.getpgid(pid) == pid != os.getpgid(os.getpid())  # its own group, not ours
    manager.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    manager.stop()  # idempotent


def test_external_urls_are_waited_for_with_a_deadline(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    manager = RolloutServerManager(experiment(engine=EngineConfig(urls=[url], launch_timeout_s=1.5)), model_dir="unused",
                                   run_dir=tmp_path)
    started = time.monotonic()
    with pytest.raises(RolloutError, match=r"GET /health: not healthy before the deadline"):
        manager.start()
    assert time.monotonic() - started < 5
    manager.stop()  # nothing launched, nothing to stop


def test_launch_failure_reports_the_log(tmp_path):
    (tmp_path / "empty").mkdir()
    cfg = experiment(engine=EngineConfig(launch_timeout_s=60))
    manager = RolloutServerManager(cfg, model_dir=str(tmp_path / "empty"), run_dir=tmp_path)
    with pytest.raises(RolloutError, match="exited before it was healthy.*no config.json"):
        manager.start()


@pytest.mark.slow
def test_a_picked_port_taken_before_the_server_binds_it_is_replaced(tmp_path, monkeypatch):
    """The race CI once lost: the port free_port picked was bound by another process before
    the server started; the server is launched again on another port, and the run goes on."""
    import socket

    import megatron_grpo.generation.manager as manager_module

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    taken_port = taken.getsockname()[1]
    picks = iter([taken_port])
    real_free_port = manager_module.free_port
    monkeypatch.setattr(manager_module, "free_port", lambda host="127.0.0.1": next(picks, None) or real_free_port(host))
    model_dir = save_tiny_model(tmp_path / "qwen2", "qwen2")
    cfg = experiment(engine=EngineConfig(api_key="k", launch_timeout_s=120))
    manager = RolloutServerManager(cfg, model_dir=str(model_dir), run_dir=tmp_path / "run")
    client = None
    try:
        (url,) = manager.start()
        assert not url.endswith(f":{taken_port}")
        log_text = manager.log_path.read_text()
        assert log_text.count("launch:") == 2 and "address already in use" in log_text
        client = RolloutClient.from_config(cfg.engine, [url])
        assert len(client.generate([[5, 6]], 1, SamplingParams(max_new_tokens=2))) == 1
    finally:
        if client is not None:
            client.close()
        manager.stop()
        taken.close()


@pytest.mark.slow
def test_a_configured_port_that_is_taken_is_an_error(tmp_path):
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        model_dir = save_tiny_model(tmp_path / "qwen2", "qwen2")
        cfg = experiment(engine=EngineConfig(port=taken.getsockname()[1], launch_timeout_s=120))
        manager = RolloutServerManager(cfg, model_dir=str(model_dir), run_dir=tmp_path / "run")
        with pytest.raises(RolloutError, match="exited before it was healthy.*address already in use"):
            manager.start()
        assert manager.log_path.read_text().count("launch:") == 1
    finally:
        taken.close()
