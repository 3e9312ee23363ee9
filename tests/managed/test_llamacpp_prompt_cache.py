"""The managed llama.cpp server's host-memory prompt cache.

Found by the soak (iop/bench/_soak.py; docs/benchmarks.md, "Soak: 30
minutes with faults"): the server a node runs for ``adapter = "llamacpp"``
grew 16 MiB a minute (262 to 527 MiB in 16 minutes, about 75 requests a
minute to SmolLM2-135M). The launcher leaves llama.cpp's ``cache_ram_mib``
at its default, 8,192 MiB: llama.cpp keeps that much of past prompts' state
in host memory. The same three-minute soak with ``cache_ram_mib = 0`` kept
the server flat (+60 KiB a minute against +32 MiB). No config key bounds it
today, so a node's memory is the model plus up to 8 GiB.
"""

from __future__ import annotations

import pytest

from iop.managed._llamacpp_server import _params, build_parser

xlc = pytest.importorskip("xllamacpp")

# llama.cpp's default host-memory prompt cache (its CommonParams.cache_ram_mib).
LLAMACPP_DEFAULT_CACHE_RAM_MIB = 8192


@pytest.mark.xfail(
    strict=True,
    reason="the managed llama.cpp server keeps llama.cpp's 8 GiB prompt cache, unbounded "
    "by any IOP key (docs/benchmarks.md, 'Soak: 30 minutes with faults')",
)
def test_the_managed_server_bounds_its_prompt_cache() -> None:
    assert xlc.CommonParams().cache_ram_mib == LLAMACPP_DEFAULT_CACHE_RAM_MIB
    args = build_parser().parse_args([])
    p = _params(xlc, args, "/models/m.gguf", None)
    assert p.cache_ram_mib < LLAMACPP_DEFAULT_CACHE_RAM_MIB
