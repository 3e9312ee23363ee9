"""The ``[[models]]`` and ``[[model_groups]]`` keys: unknown keys and bad values
are errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from iop.config import EdgeConfig, LlamaCppModel, NodeConfig, SimModel, VllmModel, load_config
from iop.errors import ConfigError

BASE = '[node]\nmemory_mib = 1000\n[[models]]\nname = "a"\nengine = "sim"\n'


def load(tmp_path: Path, text: str) -> NodeConfig:
    p = tmp_path / "node.toml"
    p.write_text(text)
    return load_config(p, NodeConfig)


def test_each_engine_decodes_with_its_keys(tmp_path: Path) -> None:
    cfg = load(
        tmp_path,
        BASE
        + "sim = { load_time_s = 2.0, memory_mib = 300 }\n"
        + '[[models]]\nname = "b"\nengine = "llamacpp"\nmemory_mib = 500\nctx = 1024\n'
        + '[[models]]\nname = "c"\nengine = "vllm"\nmemory_mib = 500\n'
        + 'command = ["vllm", "serve", "{model}", "--port", "{port}"]\n'
        + '[[model_groups]]\nname = "g"\nmembers = ["b", "c"]\n',
    )
    a, b, c = cfg.models
    assert isinstance(a, SimModel)
    assert a.memory_mib == 300  # the sim's
    assert isinstance(b, LlamaCppModel)
    assert (b.alias, b.targets) == ("b", ["b"])  # its server answers to its name
    assert isinstance(c, VllmModel)
    assert c.targets == ["c"]
    assert cfg.model_groups[0].swap


@pytest.mark.parametrize(
    ("text", "named"),
    [
        (BASE + "bogus = 1\n", "models[0].bogus"),
        (BASE + "adapter = 'sim'\n", "models[0].adapter"),
        (
            '[node]\nmemory_mib = 1000\n[[models]]\nname = "a"\nengine = "llamacpp"\n',
            "memory_mib is required",
        ),
        ('[[models]]\nname = "a"\nengine = "sim"\n', "node.memory_mib is required"),
        (BASE + "memory_mib = 2000\n", "exceeds node.memory_mib"),
        (BASE + "pinned = true\nidle_ttl_s = 5\n", "idle_ttl_s must be 0"),
        (BASE + "min_residency_s = -1\n", "min_residency_s"),
        (
            '[node]\nmemory_mib = 1000\n[[models]]\nname = "a"\nengine = "vllm"\n'
            'memory_mib = 10\ncommand = ["vllm", "serve"]\n',
            "{port}",
        ),
        (
            '[node]\nmemory_mib = 1000\n[[models]]\nname = "a"\nengine = "vllm"\n'
            'memory_mib = 10\ncommand = ["x", "{port}"]\nendpoint = "http://h:1"\n',
            "endpoint is the started process's",
        ),
        (BASE + '[[model_groups]]\nname = "g"\nmembers = ["z"]\n', "names no model 'z'"),
        (BASE + '[[instances]]\nadapter = "sim"\nname = "a"\n', "names of their own"),
        ("[node]\nmodel_load_timeout_s = 0\n", "model_load_timeout_s"),
        ("[node]\nmodel_retry_min_s = 10\nmodel_retry_max_s = 5\n", "model_retry_min_s"),
        (BASE + "sim = { load_time_s = 4000 }\n", "load_time_s"),
    ],
)
def test_a_bad_model_key_is_an_error_naming_it(tmp_path: Path, text: str, named: str) -> None:
    with pytest.raises(ConfigError) as err:
        load(tmp_path, text)
    assert named in err.value.message


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("[scheduler]\nmodel_load_wait_s = 0\n", "model_load_wait_s"),
        ("[scheduler]\nmodel_load_wait_s = 3601\n", "model_load_wait_s"),
        ("[scheduler]\nmodel_load_backoff_s = 0\n", "model_load_backoff_s"),
        ("[scheduler]\nmodel_load_backoff_s = 3601\n", "model_load_backoff_s"),
    ],
)
def test_the_edges_load_keys_are_bounded(tmp_path: Path, text: str, named: str) -> None:
    p = tmp_path / "edge.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(p, EdgeConfig)
    assert named in err.value.message
    p.write_text("[scheduler]\nmodel_load_wait_s = 3600\nmodel_load_backoff_s = 0.5\n")
    scheduler = load_config(p, EdgeConfig).scheduler
    assert (scheduler.model_load_wait_s, scheduler.model_load_backoff_s) == (3600.0, 0.5)
