"""In-process tokenization for precise prefix routing: tokenizers by model, chat templates, a prefix cache."""

from epp.tokenization.chat_template import ChatTemplate, detect_content_format
from epp.tokenization.pool import ModelTokenizer, TokenizerPool, token_ids_of
from epp.tokenization.prefix_cache import TokenizationCache

__all__ = ["ChatTemplate", "ModelTokenizer", "TokenizationCache", "TokenizerPool", "detect_content_format",
           "token_ids_of"]
