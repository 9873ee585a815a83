"""The worker API as the router sees it, torch-free: /generate and /info types, /events types,
the field readers both sides parse with, and the tokenizer."""
