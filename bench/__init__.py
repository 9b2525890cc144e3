"""The benchmarks: measurements of the picker against its peers (not installed; run from the repository)."""
