"""`kvswap loadgen`: replay a workload against any OpenAI-compatible server.

prompts.py   token ids of a workload -> text (equal hash ids -> equal text)
calibrate.py probes the server's tokenizer: how many words make an intended token
client.py    the HTTP client: GET /v1/models, streamed POSTs, SSE parsing
replay.py    one asyncio loop sending requests at their arrival times
results.py   per-request records -> the summary (percentiles, goodput, errors, lengths)
series.py    per-request records -> the report's time series
(the run judged by its own figures: kvswap.obs.loadgen_findings)
"""
