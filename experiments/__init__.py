"""The benchmark harness: measurement (memory tracker, collective counter) and benchmarks."""
