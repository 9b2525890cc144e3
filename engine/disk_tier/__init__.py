"""Keep vLLM's filesystem KV tier within its disk budget and the picker's index true."""
