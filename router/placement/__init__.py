"""Where a request runs: the Serving contract, the orchestrator's loop over a choice's phases,
the prefill and decode choices, the TTFT estimate, routes, retries and resumes, and the
per-request record they fill (``request_log``). It reads the fleet's state from
``router.workers`` and raises domain errors that ``router.http`` maps."""
