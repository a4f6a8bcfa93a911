"""The reward server: ``config`` (limits, batching, timeouts), ``bodies`` (request checks and
tokenizing), ``formats`` (each endpoint's JSON: jaxrm's, OpenRLHF's, vLLM's, SGLang's), ``limits``
(bytes held before tokenizing), ``batcher`` (the scoring worker), ``metrics`` (Prometheus), ``app``
(Starlette on uvicorn).

``python -m jaxrm.serve`` is its command line.
"""

from jaxrm.server.app import RewardServer, make_server
from jaxrm.server.config import ServerConfig

__all__ = ["RewardServer", "ServerConfig", "make_server"]
