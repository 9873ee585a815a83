"""Where a request runs: the Orchestrator contract, the TTFT cost model, worker load, prefill
and decode choice, the KV index, retries and resumes."""
