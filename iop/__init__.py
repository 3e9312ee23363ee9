"""IOP: an open inference orchestration platform.

One edge serves an OpenAI-compatible API and dispatches every request (a run)
to a node agent, which executes it through an adapter against a local backend
(vLLM, llama.cpp's server, Lemonade, Ollama, any OpenAI-compatible server).
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
