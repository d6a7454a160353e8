"""Load against a running cluster: the demo, the benchmark client and the reliability soak."""
