"""Every example config in configs/ validates, and bad keys are named."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from iop.config import EdgeConfig, NodeConfig, UpConfig, load_config
from iop.errors import ConfigError

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
ENV = {"VLLM_API_KEY": "k", "LLAMA_API_KEY": "k", "IOP_NODE_TOKEN": "t", "IOP_API_KEY": "k"}


def _kind(path: Path) -> type[object]:
    name = path.name
    if name.startswith("node"):
        return NodeConfig
    if name.startswith("edge"):
        return EdgeConfig
    if name.startswith("up"):
        return UpConfig
    from iop.sim import SimFile

    return SimFile


# configs/bench/ holds iop bench's scenarios, not process configs: those are
# checked against their runners in tests/test_bench_cli.py.
EXAMPLES = sorted(p for p in CONFIGS.rglob("*.toml") if p.parent.name != "bench")


def test_there_are_examples_for_every_process() -> None:
    names = {p.name for p in EXAMPLES}
    assert {
        "edge.toml",
        "up.toml",
        "sim.toml",
        "node-vllm.toml",
        "node-openai-compat.toml",
    } <= names
    assert (CONFIGS / "multi-node" / "node-b.toml").exists()


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_example_configs_validate(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    cfg = load_config(path, _kind(path))
    if isinstance(cfg, NodeConfig):
        assert cfg.instances
        assert cfg.node.edges


def test_unknown_key_names_key_and_file(tmp_path: Path) -> None:
    p = tmp_path / "node.toml"
    p.write_text(
        '[[instances]]\nadapter = "vllm"\nname = "a"\nendpoint = "http://x"\nmax_concurency = 3\n'
    )
    with pytest.raises(
        ConfigError, match=r"node\.toml: unknown key 'instances\[0\]\.max_concurency'"
    ):
        load_config(p, NodeConfig)


def test_unknown_nested_key(tmp_path: Path) -> None:
    p = tmp_path / "node.toml"
    p.write_text(
        '[[instances]]\nadapter = "vllm"\nname = "a"\nendpoint = "http://x"\n'
        "[instances.deadlines]\nidle_s = 1\n"
    )
    with pytest.raises(ConfigError, match=r"unknown key 'instances\[0\]\.deadlines\.idle_s'"):
        load_config(p, NodeConfig)


def test_missing_env_var_is_named_not_leaked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NOPE_KEY", raising=False)
    p = tmp_path / "node.toml"
    p.write_text(
        '[[instances]]\nadapter = "vllm"\nname = "a"\nendpoint = "http://x"\n'
        'headers = { Authorization = "Bearer ${NOPE_KEY}" }\n'
    )
    with pytest.raises(
        ConfigError,
        match=r"NOPE_KEY is not set \(used at \$\.instances\[0\]\.headers\.Authorization\)",
    ):
        load_config(p, NodeConfig)


def test_env_var_expands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("K1", "s3cret")
    p = tmp_path / "node.toml"
    p.write_text(
        '[[instances]]\nadapter = "vllm"\nname = "a"\nendpoint = "http://x"\n'
        'headers = { Authorization = "Bearer ${K1}" }\n'
    )
    cfg = load_config(p, NodeConfig)
    assert cfg.instances[0].headers == {"Authorization": "Bearer s3cret"}  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('adapter = "vllm"\nname = "a"\nendpoint = ""', "endpoint is required"),
        ('adapter = "vllm"\nname = "a"\nendpoint = "ftp://x"', "must be an http"),
        ('adapter = "vllm"\nname = ""\nendpoint = "http://x"', "name must not be empty"),
        ('adapter = "nope"\nname = "a"', "Invalid value 'nope'"),
        ('adapter = "sim"\nname = "a"\nmax_queue = -1', "max_queue must be >= 0"),
    ],
)
def test_invalid_values(tmp_path: Path, body: str, message: str) -> None:
    p = tmp_path / "node.toml"
    p.write_text(f"[[instances]]\n{body}\n")
    with pytest.raises(ConfigError, match=message):
        load_config(p, NodeConfig)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("max_queue = -1", "max_queue must be >= 0"),
        ("max_queue_delay_s = -1.0", "max_queue_delay_s must be >= 0"),
    ],
)
def test_invalid_scheduler_values(tmp_path: Path, body: str, message: str) -> None:
    p = tmp_path / "edge.toml"
    p.write_text(f"[scheduler]\n{body}\n")
    with pytest.raises(ConfigError, match=message):
        load_config(p, EdgeConfig)


def test_capacity_default_when_not_positive(tmp_path: Path) -> None:
    # Seed 003 effectiveCapacity: capacity <= 0 means the default of 8.
    p = tmp_path / "node.toml"
    p.write_text('[[instances]]\nadapter = "sim"\nname = "a"\nmax_concurrency = 0\n')
    assert load_config(p, NodeConfig).instances[0].max_concurrency == 8


def test_unreadable_and_non_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.toml", NodeConfig)
    bad = tmp_path / "bad.toml"
    bad.write_text("[[instances]\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad, NodeConfig)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("port = 70000", "port must be between 0 and 65535"),
        ('host = "10.0.0.1"', "host needs port"),
        ("prot = 9090", r"unknown key 'link\.prot'"),
    ],
)
def test_the_links_own_port_is_checked(tmp_path: Path, body: str, message: str) -> None:
    p = tmp_path / "edge.toml"
    p.write_text(f"[link]\n{body}\n")
    with pytest.raises(ConfigError, match=message):
        load_config(p, EdgeConfig)


def test_the_link_is_on_the_api_port_unless_given_its_own(tmp_path: Path) -> None:
    p = tmp_path / "edge.toml"
    p.write_text("[link]\n")
    assert load_config(p, EdgeConfig).link.port is None
    p.write_text('[link]\nport = 9090\nhost = "10.0.0.1"\n')
    link = load_config(p, EdgeConfig).link
    assert (link.host, link.port) == ("10.0.0.1", 9090)


@pytest.mark.parametrize(
    "path",
    [p for p in EXAMPLES if p.name.startswith("node")],
    ids=lambda p: str(p.relative_to(CONFIGS)),
)
def test_no_example_instance_is_the_edge_itself(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An instance on the port of the edge the node dials (8080 by default,
    llama-server's default too) would be probed as a backend: the edge itself."""
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    cfg = load_config(path, NodeConfig)
    edges = {httpx.URL(e.url).netloc for e in cfg.node.edges}
    for inst in cfg.instances:
        endpoint = getattr(inst, "endpoint", "")
        if endpoint:
            assert httpx.URL(endpoint).netloc not in edges, f"{inst.name}: {endpoint}"
