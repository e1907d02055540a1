"""`kvswap serve`: an OpenAI-compatible HTTP server over the engine, its text
(tokenizer, chat template), and `kvswap loadgen`."""
