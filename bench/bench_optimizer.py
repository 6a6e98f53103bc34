"""Sharded optimizer benchmark; see dpcore/bench/optimizer.py. Usage:
python bench/bench_optimizer.py [--devices cpu:2|0,1] [--quick] [--json FILE]"""

from dpcore.bench.optimizer import main

if __name__ == "__main__":
    main()
