"""The edge's routes: the API surfaces with their streamed and collected bodies, the admin pages
with their authentication, and models, health and metrics.
"""
