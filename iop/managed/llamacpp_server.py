"""``python -m iop.managed.llamacpp_server``: run the embedded llama.cpp server.

See ``iop.managed._llamacpp_server`` for the launcher's protocol.
"""

import sys

from iop.managed._llamacpp_server import main

if __name__ == "__main__":
    sys.exit(main())
