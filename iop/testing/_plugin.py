"""IOP's pytest plugin: a platform to test clients and services against.

Registered under pytest's ``pytest11`` entry point as ``iop``
(``pyproject.toml``), so installing ``iop`` is all it takes; ``-p no:iop``
turns it off. Only this module imports pytest, and only pytest imports this
module: ``iop`` itself does not depend on pytest. The fixtures import the
platforms when first used, so a test session that uses none of them pays
for nothing but this file.

Fixtures (docs/testing-kit.md has each with its options):

* ``iop_platform`` (function): a loopback platform (fake backend,
  ``iop edge``, ``iop node``: real processes on free ports), shared by the
  tests that ask for the same options (``@pytest.mark.iop_platform(...)``),
  idle and with a fresh ``test_mark`` as each test starts;
* ``iop_platform_factory`` (session): ``make(**options)`` starts another
  platform, stopped at the end of the session;
* ``iop_virtual`` (function): runs a scenario against the in-memory
  platform under trio's ``MockClock`` (virtual time).

When a test that used a loopback platform fails, the log tail of each of its
processes is added to the report (``--iop-log-lines``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any, Final, TypeVar

import pytest

if TYPE_CHECKING:
    from iop.testing._platform import LoopbackPlatform
    from iop.testing._virtual import VirtualPlatform

__all__ = ["PlatformFactory", "VirtualRunner"]

T = TypeVar("T")

_MARKER: Final = "iop_platform"
_DEFAULT_LOG_LINES: Final = 80
# The platforms a test used, for its failure report.
_USED = pytest.StashKey[list["LoopbackPlatform"]]()
_STARTED = pytest.StashKey[float]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("iop", "IOP testing kit (iop.testing)")
    group.addoption(
        "--iop-log-lines",
        type=int,
        default=_DEFAULT_LOG_LINES,
        metavar="N",
        help=f"lines of each IOP process's stdout and stderr shown when a test fails "
        f"(default {_DEFAULT_LOG_LINES}; 0: none)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{_MARKER}(**options): start the iop_platform fixture's platform with these "
        "options of iop.testing.start_platform (backend=, edge_config=, node_config=, "
        "instance=, sim_args=, model=); tests with equal options share one platform",
    )


class PlatformFactory:
    """``iop_platform_factory``: starts loopback platforms; stops them all at the end.

    Call it with the options of ``iop.testing.start_platform`` (all but ``log_dir``).
    """

    def __init__(self, tmp: pytest.TempPathFactory) -> None:
        self._tmp = tmp
        self.platforms: list[LoopbackPlatform] = []
        self._shared: dict[str, LoopbackPlatform] = {}

    def __call__(self, **options: Any) -> LoopbackPlatform:
        from iop.testing._platform import start_platform

        platform = start_platform(self._tmp.mktemp("iop-platform"), **options)
        self.platforms.append(platform)
        return platform

    def shared(self, **options: Any) -> LoopbackPlatform:
        """The platform for these options, started on first use."""
        key = repr(sorted(options.items()))
        platform = self._shared.get(key)
        if platform is None or not all(p.alive for p in platform.procs):
            platform = self._shared[key] = self(**options)
        return platform

    def stop_all(self) -> None:
        for platform in reversed(self.platforms):
            platform.stop()


@pytest.fixture(scope="session")
def iop_platform_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlatformFactory]:
    """Start loopback platforms: ``iop_platform_factory(backend="sim", edge_config={...})``.

    Each call starts a new backend, ``iop edge`` and ``iop node`` (real
    processes on free ports; logs under pytest's temporary directory); all
    are stopped by PID at the end of the session. Options: those of
    ``iop.testing.start_platform``.
    """
    factory = PlatformFactory(tmp_path_factory)
    try:
        yield factory
    finally:
        factory.stop_all()


@pytest.fixture
def iop_platform(
    request: pytest.FixtureRequest, iop_platform_factory: PlatformFactory
) -> LoopbackPlatform:
    """A loopback IOP platform, idle, with a fresh ``test_mark``.

    The fake backend by default (scripted with ``replay``/``replay_stream``);
    ``@pytest.mark.iop_platform(backend="sim", edge_config={...})`` chooses
    other options. Tests with the same options share one platform (started
    once per session); each test starts when the previous one's runs have
    ended, with no reply left queued on the backend, and its assertions
    count from its own start.
    """
    marker = request.node.get_closest_marker(_MARKER)
    options = dict(marker.kwargs) if marker is not None else {}
    if marker is not None and marker.args:
        raise pytest.UsageError(f"@pytest.mark.{_MARKER} takes keyword options only")
    platform = iop_platform_factory.shared(**options)
    request.node.stash.setdefault(_USED, []).append(platform)
    platform.wait_idle()
    platform.reset_backend()
    platform.test_mark = platform.mark()
    return platform


class VirtualRunner:
    """``iop_virtual``: runs scenarios against the in-memory platform in virtual time."""

    def run(self, scenario: Callable[[VirtualPlatform], Awaitable[T]], **options: Any) -> T:
        """``trio.run`` a new in-memory platform under ``MockClock(autojump_threshold=0)``
        and return ``await scenario(platform)``.

        Options: those of ``iop.testing.open_virtual_platform`` (``model``,
        ``edge_config``, ``instance``).
        """
        from iop.testing._virtual import run_virtual

        return run_virtual(scenario, **options)


@pytest.fixture
def iop_virtual() -> VirtualRunner:
    """Run ``async def scenario(platform)`` with edge, node and fake backend in
    memory, in virtual time: ``iop_virtual.run(scenario, edge_config={...})``.

    For a sync test; a trio test (pytest-trio) uses
    ``iop.testing.open_virtual_platform`` with its ``autojump_clock`` instead.
    """
    return VirtualRunner()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_STARTED] = time.time()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test that used a loopback platform gets its processes' log tails."""
    report = yield
    lines = item.config.getoption("--iop-log-lines", _DEFAULT_LOG_LINES)
    if not (report.failed and lines):
        return report
    used: list[LoopbackPlatform] = list(item.stash.get(_USED, ()))
    factory = getattr(item, "funcargs", {}).get("iop_platform_factory")
    if isinstance(factory, PlatformFactory):
        # And those the test started itself.
        since = item.stash.get(_STARTED, 0.0)
        used += [p for p in factory.platforms if p.started_at >= since and p not in used]
    for platform in used:
        for proc in platform.procs:
            report.sections.append((f"iop {proc.name} (pid {proc.pid})", proc.logs(lines)))
    return report
