"""Reading requests (the parser chain, `parsing.py`) and what the picker does to every response (`response.py`)."""

from epp.request.parsing import RequestParser, default_parsers
from epp.request.response import ResponseRewriter

__all__ = ["RequestParser", "ResponseRewriter", "default_parsers"]
