"""`kvchat bench ...`: benchmarks of the engine, each measured against a baseline in the same run."""
