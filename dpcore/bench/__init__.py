"""dpcore's microbenchmarks. Each reports a ratio against a baseline measured
in the same run (a copy_ of the same bytes, plain torch, or torch's own
DataParallel path). Run ``python bench/bench_comm.py`` or ``python -m dpcore.bench``."""
