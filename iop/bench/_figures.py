"""The runners of docs/benchmarks.md's figures, and their tables.

Each runner turns its typed options into the command line of the
measurement it wraps (``iop/bench/_platform.py``: the platform shapes;
``iop/bench/_stress.py``: cancel, memory, overload, idle-nodes) and runs it
once in this process, so that what is measured is exactly what those
modules measured as scripts. The option names are those of the command
line (``--paced-requests`` is ``paced_requests``); the defaults are its
defaults. ``ctx.smoke`` shrinks every count and duration to seconds.

Each runner's report function writes the Markdown between its scenario's
markers (``<!-- bench:SCENARIO -->``) and, for some, PNGs into docs/img/.
"""

from __future__ import annotations

import math
import textwrap
import time
from pathlib import Path
from typing import Any

import msgspec

from iop.bench import _platform, _stress
from iop.bench._runner import ReportInput, RunContext, register

__all__ = [
    "CancelOptions",
    "IdleNodesOptions",
    "MemoryOptions",
    "OverloadOptions",
    "PlatformOptions",
]


def _argv(opts: msgspec.Struct, *, repeated: tuple[str, ...] = ()) -> list[str]:
    """``opts`` as the wrapped command line: ``--name value`` per field, a
    bool as a flag, a list comma-separated (or the flag per item when the
    field is in ``repeated``)."""
    out: list[str] = []
    for name in opts.__struct_fields__:
        value = getattr(opts, name)
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out += [flag] if value else []
        elif isinstance(value, list) and name in repeated:
            for item in value:
                out += [flag, str(item)]
        elif isinstance(value, list):
            out += [flag, ",".join(str(v) for v in value)]
        else:
            out += [flag, str(value)]
    return out


_DASH = "\u2013"  # an en dash: no figure


def _fmt(v: Any, nd: int = 1, sign: bool = False) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return _DASH
    return f"{v:+,.{nd}f}" if sign else f"{v:,.{nd}f}"


def _table(head: list[str], rows: list[list[str]], right: int = 1) -> str:
    """A Markdown table; columns from ``right`` on are right-aligned."""
    align = ["---" if i < right else "---:" for i in range(len(head))]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------- platform


class PlatformOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``iop/bench/_platform.py``'s options (its ``--help`` says what each does)."""

    shapes: list[str] = msgspec.field(default_factory=lambda: list(_platform.SHAPES))
    paced_rate: float = 50.0
    paced_concurrency: int = 32
    paced_requests: int = 128
    paced_seconds: float = 6.0
    c1_requests: int = 50
    c1_chunks: int = 8
    fast_concurrency: int = 32
    sweep_chunks: list[int] = msgspec.field(default_factory=lambda: [1, 16, 64, 256])
    fast_requests: int = 256
    nonstream_requests: int = 256
    level_seconds: float = 4.0
    warmup: int = 32
    level_timeout: float = 180.0
    profile: bool = False


_PLATFORM_SMOKE: dict[str, Any] = {
    "paced_rate": 500.0,
    "paced_concurrency": 2,
    "paced_requests": 2,
    "paced_seconds": 1.0,
    "c1_requests": 2,
    "c1_chunks": 2,
    "fast_concurrency": 2,
    "sweep_chunks": [1, 4],
    "fast_requests": 4,
    "nonstream_requests": 4,
    "level_seconds": 1.0,
    "warmup": 2,
    "level_timeout": 60.0,
    "profile": False,
}


def _platform_report(r: ReportInput) -> dict[str, str]:
    res = r.median
    cells = res["cells"]
    shapes = [s for s in res["shapes"] if s != "direct"]
    by_name = {s["name"]: s for s in res["specs"]}

    def cell(level: str, shape: str) -> dict[str, Any] | None:
        c: dict[str, Any] | None = cells.get(level, {}).get(shape)
        return c

    def cpu(level: str, shape: str) -> str:
        c = cell(level, shape)
        if not c:
            return _DASH
        parts = c["cpu_ms_per_req"]
        total = _fmt(c["gateway_cpu_ms_per_req"])
        if len(parts) > 1:
            return " + ".join(_fmt(v) for v in parts.values()) + f" = {total}"
        return total

    def added(level: str, shape: str) -> str:
        c = cell(level, shape)
        if not c:
            return _DASH
        p50, p99 = c["added_ttft_p50_ms"], c["added_ttft_p99_ms"]
        return f"{_fmt(p50, sign=True)} / {_fmt(p99, sign=True)}"

    def thr(level: str, shape: str) -> str:
        c = cell(level, shape)
        return _fmt(c["throughput_pct_of_direct"]) if c else _DASH

    rows: list[list[str]] = []
    for name, spec in by_name.items():
        c = spec["concurrency"]
        if spec["kind"] == "paced":
            what = f"paced c={c}, {spec['chunks']} chunks"
            rows.append([f"{what}: CPU ms per request", *(cpu(name, s) for s in shapes)])
            rows.append([f"{what}: added TTFT p50 / p99, ms", *(added(name, s) for s in shapes)])
            rows.append([f"{what}: throughput, % of direct", *(thr(name, s) for s in shapes)])
        elif spec["kind"] == "fast":
            what = f"fast c={c}, {spec['chunks']} chunk{'s' if spec['chunks'] != 1 else ''}"
            rows.append([f"{what}: CPU ms per request", *(cpu(name, s) for s in shapes)])
        else:
            rows.append(
                [f"non-streaming c={c}: CPU ms per request", *(cpu(name, s) for s in shapes)]
            )
    fits = res.get("sweep_fit") or {}
    if fits:
        fixed, per = [], []
        for s in shapes:
            f = fits.get(s)
            if not f:
                fixed.append(_DASH)
                per.append(_DASH)
                continue
            procs = [k for k in f if k != "gateway"]
            g = f["gateway"]
            if procs:
                fixed.append(
                    " + ".join(_fmt(f[k]["fixed_ms"], 2) for k in procs)
                    + f" = {_fmt(g['fixed_ms'], 2)}"
                )
                per.append(
                    " + ".join(_fmt(f[k]["per_chunk_us"]) for k in procs)
                    + f" = {_fmt(g['per_chunk_us'])}"
                )
            else:
                fixed.append(_fmt(g["fixed_ms"], 2))
                per.append(_fmt(g["per_chunk_us"]))
        rows.append(["fast: fixed ms per request (fit over the sweep)", *fixed])
        rows.append(["fast: µs per chunk (fit over the sweep)", *per])
    foreign = [
        c.get("foreign_cpu_pct_of_core")
        for by in cells.values()
        for c in by.values()
        if c.get("foreign_cpu_pct_of_core") is not None
    ]
    head = ["figure", *(_platform._LABELS[s] for s in shapes)]
    text = _table(head, rows)
    if foreign:
        text += (
            f"\n\nForeign CPU per window: {min(foreign):.0f}{_DASH}{max(foreign):.0f} % of a core."
        )
    skipped = res.get("skipped") or {}
    if skipped:
        text += (
            " Skipped: "
            + "; ".join(f"{k} ({v.split('(')[0].strip()})" for k, v in skipped.items())
            + "."
        )
    imgs = _platform.plot(res, r.img_dir)
    links = "\n\n".join(f"![{p.stem}](img/{p.name})" for p in imgs)
    return {r.scenario: f"{text}\n\n{links}\n\n{r.footer}"}


@register(
    "platform",
    PlatformOptions,
    "CPU per request, added TTFT, throughput: direct, iop up, edge + node, LiteLLM "
    "(paced c=32 and c=1, a chunk-count sweep, non-streaming)",
    report=_platform_report,
)
def run_platform(opts: PlatformOptions, ctx: RunContext) -> dict[str, Any]:
    if ctx.smoke:
        opts = msgspec.structs.replace(opts, **_PLATFORM_SMOKE)
    shapes = [s for s in opts.shapes if s != "litellm" or ctx.litellm is not None]
    opts = msgspec.structs.replace(opts, shapes=shapes)
    argv = [*_argv(opts), "--repeat", "1", "--no-plots", "--out-dir", str(ctx.workdir)]
    argv += ["--python", ctx.python]
    if ctx.litellm is not None:
        argv += ["--litellm", str(ctx.litellm)]
    args = _platform.parse_args(argv)
    result, failed = _platform.run_all(args)
    result["failed_requests"] = failed
    return result


# --------------------------------------------------------------------------- stress


def _stress_step(step: str, argv: list[str], ctx: RunContext) -> dict[str, Any]:
    """One measurement of ``_stress`` (``--only STEP``) in its own processes."""
    args = _stress.parse_args(
        ["--only", step, "--out-dir", str(ctx.workdir), "--python", ctx.python, *argv]
    )
    args.stamp = time.strftime("%Y%m%d-%H%M%S")
    fd_limit = _stress._raise_fd_limit()
    run = _stress.STEP_RUNNERS[step][0]
    with _stress.process_stack(args.python, ctx.workdir) as stack:
        res = run(args, stack)
    res["fd_limit"] = fd_limit
    return res


class CancelOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The cancel measurement's options (``iop/bench/_stress.py``'s cancel group).

    ``litellm``: measure LiteLLM in the same windows too, when ``--litellm``
    is given.
    """

    trials: int = 20
    windows: list[str] = msgspec.field(default_factory=lambda: list(_stress.WINDOWS))
    settle_ms: float = 20.0
    mid_chunks: int = 8
    poll_ms: float = 20.0
    litellm: bool = False
    litellm_trials: int = 5
    litellm_eof_s: float = 2.0
    litellm_cancel_on_disconnect: bool = False


def _ms_cell(w: dict[str, Any] | None) -> list[str]:
    if not w:
        return [_DASH, _DASH, _DASH]
    m = w["ms"]
    return [_fmt(m.get("p50")), _fmt(m.get("p99")), _fmt(m.get("max"))]


def _cancel_report(r: ReportInput) -> dict[str, str]:
    res = r.median
    lite = res.get("litellm")
    first = r.repeats[0] if r.repeats else res
    n = res["settings"]["trials"]
    head = ["window", "IOP p50 ms", "p99 ms", "max ms"]
    if lite:
        head += ["LiteLLM p50 ms", "p99 ms", "LiteLLM never closed"]
    rows = []
    for window, w in res["windows"].items():
        row = [window, *_ms_cell(w)]
        if lite:
            lw = lite["windows"].get(window)
            if lw is None:
                row += ["n/a (no queue)", "", ""]
            else:
                never = sum(
                    v
                    for rep in r.repeats
                    for k, v in rep["litellm"]["windows"][window]["errors"].items()
                    if k.startswith("no EOF")
                )
                total = sum(
                    len(rep["litellm"]["windows"][window]["samples_ms"]) for rep in r.repeats
                )
                p50, p99 = (lw["ms"].get("p50"), lw["ms"].get("p99"))
                row += [_fmt(p50), _fmt(p99), f"{never} of {total}"]
        rows.append(row)
    leaked = len(first["windows"].get("queued", {}).get("leaked_to_backend", []))
    text = _table(head, rows)
    text += (
        f"\n\nIOP: {n} trials per window (median of the repeats' percentiles); the client's "
        f"close → the backend's EOF (queued: → the edge's dequeue); queued runs that reached "
        f"the backend: {leaked}."
    )
    if lite:
        text += (
            f" LiteLLM {res.get('litellm_version') or '?'}: {lite['trials']} trials per window "
            f"and repeat, a trial waits {lite['eof_wait_s']:g} s for the backend's EOF "
            f'("never closed": it did not come); cancel_on_disconnect '
            f"{'on' if lite['cancel_on_disconnect'] else 'off (its default)'}."
        )
        imgs = _cancel_plot(r)
        text += "\n\n" + "\n\n".join(f"![{p.stem}](img/{p.name})" for p in imgs)
    return {r.scenario: f"{text}\n\n{r.footer}"}


def _cancel_plot(r: ReportInput) -> list[Path]:
    _platform.import_matplotlib()
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    res = r.median
    lite = res["litellm"]
    windows = list(res["windows"])
    wait_ms = 1000 * lite["eof_wait_s"]
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(windows))
    iop = [res["windows"][w]["ms"].get("p50") or 0 for w in windows]
    ax.bar([x - 0.2 for x in xs], iop, 0.4, color="#4C72B0")
    for x, w in zip(xs, windows, strict=True):
        lw = lite["windows"].get(w)
        if lw is None:
            ax.text(x + 0.2, 1, "no queue", rotation=90, ha="center", va="bottom", fontsize=8)
        elif lw["ms"].get("p50") is None:
            ax.bar(x + 0.2, wait_ms, 0.4, color="none", edgecolor="#C44E52", hatch="//")
            label = f"none in {lite['eof_wait_s']:g} s"
            ax.text(x + 0.2, wait_ms, label, ha="center", va="bottom", fontsize=8)
        else:
            ax.bar(x + 0.2, lw["ms"]["p50"], 0.4, color="#C44E52")
    ax.set_yscale("log")
    ax.set_xticks(list(xs), windows, fontsize=8)
    ax.set_ylabel("client close → backend EOF, p50 ms (log)")
    ax.set_title("Cancellation latency by window", fontsize=10)
    handles = [
        Patch(color="#4C72B0", label="IOP (edge + node)"),
        Patch(color="#C44E52", label=f"LiteLLM {res.get('litellm_version') or ''}".strip()),
        Patch(facecolor="none", edgecolor="#C44E52", hatch="//", label="LiteLLM: no EOF came"),
    ]
    ax.legend(handles=handles, fontsize=8, loc="upper left")
    fig.text(0.01, 0.01, textwrap.fill(r.footer.strip("_").replace("`", ""), 160), fontsize=6)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    r.img_dir.mkdir(parents=True, exist_ok=True)
    out = r.img_dir / f"bench_{r.scenario}.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [out]


@register(
    "cancel",
    CancelOptions,
    "Client hang-up -> backend EOF, per window (queued, before headers, before the first "
    "token, mid-stream, non-streaming); LiteLLM beside it with --litellm",
    report=_cancel_report,
)
def run_cancel(opts: CancelOptions, ctx: RunContext) -> dict[str, Any]:
    if ctx.smoke:
        opts = msgspec.structs.replace(opts, trials=1, litellm_trials=1, litellm_eof_s=0.5)
    with_litellm = opts.litellm and ctx.litellm is not None
    opts = msgspec.structs.replace(opts, litellm=False)
    argv = [a for a in _argv(opts) if a != "--litellm"]
    if with_litellm:
        argv += ["--litellm", str(ctx.litellm)]
    res = _stress_step("cancel", argv, ctx)
    res.pop("trials", None)  # per-trial clock readings: for --perf-trace, not the report
    return res


class MemoryOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The memory measurement's options (idle streams held open)."""

    streams: int = 1000
    rounds: int = 1
    open_concurrency: int = 64
    settle_s: float = 3.0


def _memory_report(r: ReportInput) -> dict[str, str]:
    res = r.median
    rows = []
    for rd in res["rounds"]:
        rk, kb = rd["rss_kb"], rd["kb_per_stream"]
        rows.append(
            [
                str(rd["round"]),
                str(rd["opened"]),
                f"{rk['before']['edge']:,} / {rk['open']['edge']:,} / {rk['after']['edge']:,}",
                f"{rk['before']['node']:,} / {rk['open']['node']:,} / {rk['after']['node']:,}",
                f"{_fmt(kb['edge'])} / {_fmt(kb['node'])} / **{_fmt(kb['edge+node'])}**",
                _fmt(rd["returned_pct"]["edge+node"], 0),
            ]
        )
    head = [
        "round",
        "streams open",
        "edge RSS KiB before / open / after",
        "node RSS KiB",
        "KiB per stream edge / node / both",
        "returned after the close, %",
    ]
    text = _table(head, rows)
    return {r.scenario: f"{text}\n\n{r.footer}"}


@register(
    "memory",
    MemoryOptions,
    "RSS of edge and node with N idle streams open, and after they close",
    report=_memory_report,
)
def run_memory(opts: MemoryOptions, ctx: RunContext) -> dict[str, Any]:
    if ctx.smoke:
        opts = msgspec.structs.replace(opts, streams=5, rounds=1, open_concurrency=5, settle_s=0.2)
    return _stress_step("memory", _argv(opts), ctx)


class OverloadOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The overload measurement's options (open-loop levels over the saturated rate)."""

    seed: int = 1
    levels: list[int] = msgspec.field(default_factory=lambda: [80, 90, 100, 90, 120, 90, 150])
    duration_s: float = 15.0
    arrivals: str = "poisson"
    sat_concurrency: int = 32
    sat_s: float = 10.0
    resat_s: float = 5.0
    client_timeout_s: float = 10.0
    max_outstanding: int = 4000
    pause_s: float = 1.0
    paced_rate: float = 0.0
    max_concurrency: int = 32
    node_max_queue: int = 256
    edge_set: list[str] = msgspec.field(default_factory=list)
    instance_set: list[str] = msgspec.field(default_factory=list)


def _overload_report(r: ReportInput) -> dict[str, str]:
    res = r.median
    rows = []
    for lv in res["levels"]:
        other = sum(v for k, v in lv["errors"].items() if not k.startswith("HTTP 429"))
        t = lv["ttft_ms"]
        rows.append(
            [
                f"{lv['level_pct']} %",
                _fmt(lv["saturated_rps"]),
                _fmt(lv["offered_rps"]),
                f"{_fmt(lv['goodput_rps'])} / {_fmt(lv['ok_rps'])}",
                str(lv["refused_429"]),
                str(other),
                f"{_fmt(t.get('p50'), 0)} / {_fmt(t.get('p99'), 0)}",
                _fmt(lv["edge_node_cpu_ms_per_ok"], 2),
                _fmt(lv["foreign_cpu_pct_of_core"], 0),
            ]
        )
    head = [
        "level",
        "saturated req/s",
        "offered req/s",
        "goodput / ok/s",
        "429s",
        "other errors",
        "TTFT p50 / p99 ms",
        "edge+node CPU ms per answer",
        "foreign %",
    ]
    sat = res["saturation"]
    text = _table(head, rows)
    kinds: dict[str, int] = {}
    for lv in res["levels"]:
        for k, v in lv["errors"].items():
            if not k.startswith("HTTP 429"):
                kinds[k] = kinds.get(k, 0) + v
    if kinds:
        text += (
            "\n\nOther errors, all levels: "
            + ", ".join(f"{k}: {v}" for k, v in sorted(kinds.items()))
            + "."
        )
    text += (
        f"\n\nClosed loop c={sat['concurrency']} at the start: {_fmt(sat['goodput_rps'])} req/s, "
        f"edge + node {_fmt(sat['edge_node_cpu_ms_per_ok'], 2)} ms CPU per answer."
    )
    return {r.scenario: f"{text}\n\n{r.footer}"}


@register(
    "overload",
    OverloadOptions,
    "Open-loop levels in % of the saturated rate: goodput, 429s, TTFT, CPU per answer",
    report=_overload_report,
)
def run_overload(opts: OverloadOptions, ctx: RunContext) -> dict[str, Any]:
    if ctx.smoke:
        opts = msgspec.structs.replace(
            opts,
            levels=[100],
            duration_s=0.5,
            sat_concurrency=2,
            sat_s=0.5,
            resat_s=0.0,
            pause_s=0.1,
            client_timeout_s=5.0,
        )
    return _stress_step("overload", _argv(opts, repeated=("edge_set", "instance_set")), ctx)


class IdleNodesOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The idle-nodes measurement's options (one edge, N idle node links)."""

    nodes: int = 100
    real_nodes: int = 4
    idle_s: float = 20.0
    loss_trials: int = 3


def _idle_report(r: ReportInput) -> dict[str, str]:
    res = r.median
    rows = [
        [
            "edge, no node connected",
            f"{_fmt(res['edge_alone']['cpu_pct_of_core']['edge'], 2)} % of a core",
        ],
        [
            f"**edge, {res['nodes']} idle nodes**",
            f"**{_fmt(res['edge_cpu_pct_of_core'], 2)} % of a core** "
            f"({_fmt(res['edge_cpu_ms_per_node_s'], 3)} ms per node per second)",
        ],
        [
            f"an `iop node` process ({res['real_nodes']} measured, 10 ms clock ticks)",
            f"{_fmt(res['real_node_cpu_ms_per_s'], 2)} ms per second",
        ],
    ]
    if "agent_cpu_ms_per_node_s" in res:
        rows.append(
            [
                "a `NodeAgent` in the shared process",
                f"{_fmt(res['agent_cpu_ms_per_node_s'], 2)} ms per second",
            ]
        )
    rows.append(
        [
            "node frozen (SIGSTOP) → gone from `/admin/nodes`",
            ", ".join(_fmt(x, 2) for x in res["loss_sigstop_s"]) + " s",
        ]
    )
    rows.append(["node killed (SIGKILL) → gone", f"{_fmt(res['loss_sigkill_s'], 2)} s"])
    text = _table(["", "CPU"], rows)
    text += f"\n\nForeign CPU during the idle window: {_fmt(res['idle']['foreign_cpu_pct_of_core'], 0)} % of a core."
    return {r.scenario: f"{text}\n\n{r.footer}"}


@register(
    "idle-nodes",
    IdleNodesOptions,
    "Edge CPU with N idle node links; how fast a frozen or killed node is dropped",
    report=_idle_report,
)
def run_idle_nodes(opts: IdleNodesOptions, ctx: RunContext) -> dict[str, Any]:
    if ctx.smoke:
        opts = msgspec.structs.replace(opts, nodes=2, real_nodes=2, idle_s=1.0, loss_trials=1)
    return _stress_step("idle-nodes", _argv(opts), ctx)
