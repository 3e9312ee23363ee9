"""Measure what unauthenticated link connections cost an edge process.

Starts ``python -m iop edge`` on a free port, opens ``--clients`` WebSocket
connections to ``/v1/link`` at once, and has each send one binary frame of
``--frame-mib`` MiB before any hello. Prints the edge's peak RSS (VmHWM)
before and after, and the close code each client got.

Run:  python scripts/link_preauth_rss.py [--clients 4] [--frame-mib 64]
      [--code DIR]  (DIR holds another ``iop`` package to measure, e.g. one
      from ``git archive``; it is imported instead of the installed one.)
docs/operations.md "The node link" quotes the numbers.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio
from trio_websocket import ConnectionClosed, open_websocket_url


def _peak_rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    m = re.search(r"VmHWM:\s+(\d+) kB", status)
    assert m is not None
    return int(m.group(1)) / 1024


async def _client(url: str, frame: bytes, codes: list[object]) -> None:
    try:
        async with open_websocket_url(url, max_message_size=1 << 20) as ws:
            await ws.send_message(frame)
            with trio.move_on_after(20):
                await ws.get_message()
    except ConnectionClosed as exc:
        codes.append(exc.reason.code if exc.reason else None)
        return
    except OSError as exc:
        codes.append(f"oserror: {exc}")
        return
    codes.append("open")


async def _run(url: str, clients: int, frame_mib: int) -> list[object]:
    frame = b"\x00" * (frame_mib << 20)
    codes: list[object] = []
    async with trio.open_nursery() as nursery:
        for _ in range(clients):
            nursery.start_soon(_client, url, frame, codes)
    return codes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--frame-mib", type=int, default=64)
    ap.add_argument("--code", default="")
    args = ap.parse_args()
    argv = [sys.executable, "-m", "iop"]
    if args.code:
        # An editable install's finder comes before sys.path: drop it.
        boot = (
            "import sys; sys.meta_path[:] = [f for f in sys.meta_path "
            "if 'editable' not in getattr(f, '__module__', '')]; "
            f"sys.path.insert(0, {args.code!r}); sys.argv[0] = 'iop'; "
            "from iop.cli import main; sys.exit(main())"
        )
        argv = [sys.executable, "-c", boot]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "edge.out"
        with out.open("wb") as fh:
            edge = subprocess.Popen(
                [*argv, "edge", "--port", "0", "--node-token", "t"],
                stdout=fh,
                stderr=subprocess.STDOUT,
            )
        try:
            deadline = time.monotonic() + 30
            while not (m := re.search(r"nodes dial (ws://\S+)", out.read_text())):
                if time.monotonic() > deadline or edge.poll() is not None:
                    raise SystemExit(f"edge did not start:\n{out.read_text()}")
                time.sleep(0.05)
            before = _peak_rss_mib(edge.pid)
            codes = trio.run(_run, m.group(1), args.clients, args.frame_mib)
            time.sleep(0.5)
            after = _peak_rss_mib(edge.pid)
            logged = [ln for ln in out.read_text().splitlines() if "1009" in ln]
        finally:
            edge.terminate()
            edge.wait(15)
    print(
        json.dumps(
            {
                "clients": args.clients,
                "frame_mib": args.frame_mib,
                "peak_rss_mib_before": round(before, 1),
                "peak_rss_mib_after": round(after, 1),
                "close_codes": codes,
                "log_lines_1009": len(logged),
                "first_log_line": logged[0] if logged else None,
            }
        )
    )


if __name__ == "__main__":
    main()
