"""Token ids to text: incremental detokenization and stop strings."""
