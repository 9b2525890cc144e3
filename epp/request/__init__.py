"""Request and response handling of the OpenAI-style bodies the picker sees."""

from epp.request.parsing import RequestParser, api_kind_for_path
from epp.request.response import ResponseRewriter, parse_usage

__all__ = ["RequestParser", "ResponseRewriter", "api_kind_for_path", "parse_usage"]
