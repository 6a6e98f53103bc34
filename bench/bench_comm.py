"""Collective bandwidth benchmark; see dpcore/bench/comm.py. Usage:
python bench/bench_comm.py [--devices cpu:4|0,0,0,0] [--quick] [--json FILE]"""

from dpcore.bench.comm import main

if __name__ == "__main__":
    main()
