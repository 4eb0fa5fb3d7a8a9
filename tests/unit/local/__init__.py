"""Local vLLM servers: the launcher without vLLM."""
