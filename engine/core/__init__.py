"""The engine core: requests, sampling, the block pool, the scheduler and LLMEngine's step.
No HTTP, no etcd."""
