"""`make bench-gpu`: the benchmarks on a GPU machine without network (pack here, run there)."""
