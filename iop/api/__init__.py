"""The API surfaces the edge speaks, each a sans-IO package (see ``_surface``).

* ``_surface``: the interface (``Surface``, ``Call``, ``RunContext``,
  ``StreamEncoder``, ``Collector``);
* ``_output``: ``OutputShaper``, the output policy applied once for every
  surface, into the shaped events of ``_shaped``;
* ``_openai_errors``: OpenAI's error body and IOP's failure statuses;
* ``_models``: ``GET /v1/models``' body;
* ``chat``: OpenAI Chat Completions (``CHAT``).
"""

from iop.api._models import model_list_body
from iop.api._output import OutputShaper, shape_failure
from iop.api._shaped import Shaped, ShapedDone, ShapedFailed, ShapedReasoning, ShapedText
from iop.api._surface import Call, Collector, RunContext, StreamEncoder, Surface
from iop.api.chat import CHAT, ChatSurface

__all__ = [
    "CHAT",
    "Call",
    "ChatSurface",
    "Collector",
    "OutputShaper",
    "RunContext",
    "Shaped",
    "ShapedDone",
    "ShapedFailed",
    "ShapedReasoning",
    "ShapedText",
    "StreamEncoder",
    "Surface",
    "model_list_body",
    "shape_failure",
]
