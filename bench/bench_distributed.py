"""Hybrid data-parallel training-step benchmark over gloo; see
dpcore/bench/distributed.py. Usage:
python bench/bench_distributed.py [--quick] [--repeats N] [--json FILE]"""

from dpcore.bench.distributed import main

if __name__ == "__main__":
    main()
