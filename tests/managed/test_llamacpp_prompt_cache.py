"""The managed llama.cpp server's host-memory prompt cache.

Found by the soak (iop/bench/_soak.py; docs/benchmarks.md, "Soak: 30
minutes with faults"): the server a node runs for ``adapter = "llamacpp"``
grew 16 MiB a minute (262 to 527 MiB in 16 minutes, about 75 requests a
minute to SmolLM2-135M). The launcher leaves llama.cpp's ``cache_ram_mib``
at its default, 8,192 MiB: llama.cpp keeps that much of past prompts' state
in host memory. The same three-minute soak with ``cache_ram_mib = 0`` kept
the server flat (+60 KiB a minute against +32 MiB). ``cache_ram_mib`` (of a
``llamacpp`` instance and of ``[embedded]``) now bounds it, 256 MiB by default.
"""

from __future__ import annotations

import pytest

from iop.config import (
    DEFAULT_LLAMACPP_CACHE_RAM_MIB,
    EmbeddedBackend,
    LlamaCppInstance,
    NodeConfig,
    decode_config,
)
from iop.errors import ConfigError
from iop.managed._adapter import llamacpp_settings
from iop.managed._llamacpp import launcher_command
from iop.managed._llamacpp_server import _params, build_parser

xlc = pytest.importorskip("xllamacpp")

# llama.cpp's default host-memory prompt cache (its CommonParams.cache_ram_mib).
LLAMACPP_DEFAULT_CACHE_RAM_MIB = 8192


def test_the_managed_server_bounds_its_prompt_cache() -> None:
    assert xlc.CommonParams().cache_ram_mib == LLAMACPP_DEFAULT_CACHE_RAM_MIB
    args = build_parser().parse_args([])
    p = _params(xlc, args, "/models/m.gguf", None)
    assert p.cache_ram_mib == DEFAULT_LLAMACPP_CACHE_RAM_MIB < LLAMACPP_DEFAULT_CACHE_RAM_MIB


@pytest.mark.parametrize("mib", [0, 64])
def test_the_instances_key_reaches_the_server(mib: int) -> None:
    """``cache_ram_mib`` of a node's instance (and of ``[embedded]``) is the
    launcher's ``--cache-ram-mib``, which sets llama.cpp's ``cache_ram_mib``."""
    inst = decode_config(
        {"instances": [{"adapter": "llamacpp", "name": "l", "cache_ram_mib": mib}]},
        NodeConfig,
        source="node.toml",
    ).instances[0]
    assert isinstance(inst, LlamaCppInstance)
    cmd = launcher_command(llamacpp_settings(inst))
    assert cmd[cmd.index("--cache-ram-mib") + 1] == str(mib)
    args = build_parser().parse_args(cmd[cmd.index("--host") :])
    assert _params(xlc, args, "/models/m.gguf", None).cache_ram_mib == mib
    assert EmbeddedBackend(cache_ram_mib=mib).cache_ram_mib == mib


def test_a_cache_beyond_its_bound_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"cache_ram_mib must be 0\.\.1048576, got -1"):
        decode_config(
            {"instances": [{"adapter": "llamacpp", "name": "l", "cache_ram_mib": -1}]},
            NodeConfig,
            source="node.toml",
        )
