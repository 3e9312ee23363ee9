"""The edge's HTTP server layer: hypercorn serving, HTTP/1 limits, the stall guard, TLS, CORS,
the ASGI plumbing the routes write through, and the link endpoint with its frame guard.

Nothing here knows what a run or a tenant is; the routes (``iop.edge.routes``) and the core
(``iop.edge._core``) sit on top of it. docs/architecture.md, "The edge", draws the layers.
"""
