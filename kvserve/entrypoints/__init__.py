"""Entry points: the CLI (and, later, the OpenAI-compatible server)."""
