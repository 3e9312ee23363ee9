"""The API surfaces the edge speaks, each a sans-IO package (see ``_surface``).

* ``_surface``: the interface (``Surface``, ``Call``, ``RunContext``,
  ``StreamEncoder``, ``Collector``);
* ``_output``: ``OutputShaper``, the output policy applied once for every
  surface, into the shaped events of ``_shaped``;
* ``_openai_errors``: OpenAI's error body and IOP's failure statuses;
* ``_collect``: the ending every surface's collector shares;
* ``_json_guard``: the body-level input guards every surface's parser runs first;
* ``_models``: the bodies of ``GET /v1/models`` and ``/v1/models/{id}``;
* ``chat``: OpenAI Chat Completions (``CHAT``);
* ``responses``: OpenAI Responses (``ResponsesSurface``, over a response store);
* ``messages``: Anthropic Messages and count_tokens (``MESSAGES``);
* ``completions``, ``embeddings``: legacy completions and embeddings
  (``COMPLETIONS``, ``EMBEDDINGS``), their own run operations.
"""

from iop.api._models import (
    anthropic_model_body,
    anthropic_model_list_body,
    model_body,
    model_list_body,
    wants_anthropic,
)
from iop.api._output import OutputShaper, shape_failure
from iop.api._routing import (
    OBJECTIVE_HEADERS,
    SESSION_HEADERS,
    SLO_TTFT_HEADER,
    routing_of,
    with_routing,
)
from iop.api._shaped import Shaped, ShapedDone, ShapedFailed, ShapedReasoning, ShapedText
from iop.api._surface import Call, Collector, RunContext, StreamEncoder, Surface
from iop.api.chat import CHAT, ChatSurface
from iop.api.completions import COMPLETIONS, CompletionsSurface
from iop.api.embeddings import EMBEDDINGS, EmbeddingsSurface
from iop.api.messages import AUTH_FAILED as ANTHROPIC_AUTH_FAILED
from iop.api.messages import MESSAGES, MessagesSurface, estimate_input_tokens
from iop.api.messages import api_key as anthropic_api_key
from iop.api.responses import ResponsesSurface

__all__ = [
    "ANTHROPIC_AUTH_FAILED",
    "CHAT",
    "COMPLETIONS",
    "EMBEDDINGS",
    "MESSAGES",
    "OBJECTIVE_HEADERS",
    "SESSION_HEADERS",
    "SLO_TTFT_HEADER",
    "Call",
    "ChatSurface",
    "Collector",
    "CompletionsSurface",
    "EmbeddingsSurface",
    "MessagesSurface",
    "OutputShaper",
    "ResponsesSurface",
    "RunContext",
    "Shaped",
    "ShapedDone",
    "ShapedFailed",
    "ShapedReasoning",
    "ShapedText",
    "StreamEncoder",
    "Surface",
    "anthropic_api_key",
    "anthropic_model_body",
    "anthropic_model_list_body",
    "estimate_input_tokens",
    "model_body",
    "model_list_body",
    "routing_of",
    "shape_failure",
    "wants_anthropic",
    "with_routing",
]
