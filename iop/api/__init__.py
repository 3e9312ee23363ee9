"""The API surfaces the edge speaks, each a sans-IO package (see ``_surface``)."""

from iop.api._surface import Call, Collector, RunContext, StreamEncoder, Surface

__all__ = ["Call", "Collector", "RunContext", "StreamEncoder", "Surface"]
