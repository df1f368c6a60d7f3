"""Applications on top of the launcher: the CLI, the demo, soak, benchmarks, reports and the
simulator."""
