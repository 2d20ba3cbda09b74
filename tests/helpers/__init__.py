"""Helpers shared by the test packages (a test package never imports another one's modules).

cli: the CLI run in-process; datasets: small generated datasets and byte-level edits; sampler_data:
datasets whose records encode their key; corpora: raw corpora for the converters; parts: conversions
in parts compared; order_stats: the order tests' statistics; benchmarks: import a benchmark script;
seaweed / faultproxy: a real S3-compatible server and a latency/fault proxy; profiling: checks of a
profile; consumers: the order battery through the sampler's tiers and a DataLoader, per codec."""
