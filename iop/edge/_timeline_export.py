"""The opt-in JSONL export of finished runs' timelines, with a size cap.

``[timelines] export_path`` set: every finished run's timeline
(``Timeline.to_json``) becomes one line of that file. Runs never wait for
the disk: a finished run's line goes into a bounded channel
(``EXPORT_BUFFER`` lines); one task takes what is there, writes it in a
worker thread, and rotates the file before it would pass
``export_max_bytes`` (``PATH`` -> ``PATH.1`` -> ... -> ``PATH.<export_keep>``,
the oldest deleted). A full channel drops the line and counts it
(``dropped``, in /admin and the log): a slow disk costs lines, not runs.
A file the export makes has mode 0600: it holds every tenant's run ids.

A run the edge cancelled ends on the edge before its node's side of the
timeline comes back with the node's terminal (milliseconds later): its line
waits for it, at most ``NODE_PART_WAIT_S``, and is written without it after
that (a node that was lost never sends it).
"""

from __future__ import annotations

import logging
import math
import os
from collections import deque
from pathlib import Path
from typing import Final

import msgspec
import trio

from iop.config import TimelineSettings
from iop.timeline import Timeline

__all__ = ["EXPORT_BUFFER", "TimelineExport"]

log = logging.getLogger("iop.edge.timelines")

# Lines waiting for the writer: a few seconds of a busy edge's finished runs.
EXPORT_BUFFER: Final = 4096

# How long a cancelled run's line waits for its node's side of the timeline:
# the Cancel's round trip over the link, with room for a loaded node.
NODE_PART_WAIT_S: Final = 2.0

# Cancelled runs' lines held for their node's side at most: a storm of
# cancels writes the oldest without it rather than holding them all.
NODE_PART_WAITING_MAX: Final = EXPORT_BUFFER

_ENCODER: Final = msgspec.json.Encoder()

# The export is the operator's: readable by the edge's user alone.
_FILE_MODE: Final = 0o600


def _awaits_node(timeline: Timeline) -> bool:
    """A run the edge cancelled on a node whose side has not come back yet."""
    return (
        timeline.node is None
        and timeline.cancel_sent is not None
        and bool(timeline.placements)
        and timeline.placements[-1].result == "cancelled"
    )


class TimelineExport:
    """The JSONL writer (module docstring). ``run`` is its task."""

    def __init__(self, settings: TimelineSettings) -> None:
        self.path = Path(settings.export_path)
        self.max_bytes = settings.export_max_bytes
        self.keep = settings.export_keep
        self._send, self._receive = trio.open_memory_channel[Timeline](EXPORT_BUFFER)
        self.written = 0
        self.dropped = 0
        self.rotations = 0

    def add(self, timeline: Timeline) -> None:
        """Queue ``timeline``'s line; never waits (a full buffer drops it)."""
        try:
            self._send.send_nowait(timeline)
        except trio.ClosedResourceError:
            self.dropped += 1  # a run that ended after the export closed
        except trio.WouldBlock:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning(
                    "timeline export to %s is behind: %d line(s) dropped so far",
                    self.path,
                    self.dropped,
                )

    def close(self) -> None:
        """No more lines: ``run`` writes what is queued, then returns."""
        self._send.close()

    async def run(self) -> None:
        """Write queued lines until ``close`` (then the rest) or cancelled."""
        size = await trio.to_thread.run_sync(self._current_size)
        # Cancelled runs waiting for their node's side, oldest first.
        waiting: deque[tuple[float, Timeline]] = deque()
        closed = False
        while not closed or waiting:
            got: list[Timeline] = []
            if not closed:
                wait = waiting[0][0] - trio.current_time() if waiting else math.inf
                with trio.move_on_after(max(wait, 0.0)):
                    try:
                        got.append(await self._receive.receive())
                        while True:
                            got.append(self._receive.receive_nowait())
                    except trio.WouldBlock:
                        pass
                    except trio.EndOfChannel:
                        closed = True
            now = trio.current_time()
            ready: list[Timeline] = []
            while waiting and (closed or waiting[0][1].node is not None or waiting[0][0] <= now):
                ready.append(waiting.popleft()[1])
            for timeline in got:
                if _awaits_node(timeline):
                    waiting.append((now + NODE_PART_WAIT_S, timeline))
                else:
                    ready.append(timeline)
            while len(waiting) > NODE_PART_WAITING_MAX:
                ready.append(waiting.popleft()[1])
            if ready:
                lines = [_ENCODER.encode(t.to_json()) + b"\n" for t in ready]
                size = await trio.to_thread.run_sync(self._write, lines, size)

    def _current_size(self) -> int:
        """The export file's size now (0: not there yet)."""
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def _write(self, lines: list[bytes], size: int) -> int:
        """Append ``lines``, rotating first whenever the next would pass the cap."""
        batch: list[bytes] = []
        batch_size = 0
        for line in lines:
            if size + batch_size + len(line) > self.max_bytes and (size or batch_size):
                self._append(batch)
                batch, batch_size = [], 0
                self._rotate()
                size = 0
            batch.append(line)
            batch_size += len(line)
        self._append(batch)
        return size + batch_size

    def _append(self, batch: list[bytes]) -> None:
        if not batch:
            return
        try:
            # 0600 when it is made: every tenant's run ids and names are in it
            # (docs/operations.md, "Tenants and limits"); rotation keeps the mode.
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, _FILE_MODE)
            with open(fd, "ab") as f:
                f.write(b"".join(batch))
            self.written += len(batch)
        except OSError as exc:
            self.dropped += len(batch)
            log.warning("timeline export to %s failed: %s", self.path, exc)

    def _rotate(self) -> None:
        self.rotations += 1
        if self.keep == 0:
            self.path.unlink(missing_ok=True)
            return
        oldest = self.path.with_name(f"{self.path.name}.{self.keep}")
        oldest.unlink(missing_ok=True)
        for n in range(self.keep - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{n}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{n + 1}"))
        if self.path.exists():
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
