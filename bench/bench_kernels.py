"""Kernel and host-transfer benchmark; see dpcore/bench/kernels.py. Usage:
python bench/bench_kernels.py [--devices cpu:4|0,0,0,0] [--quick] [--json FILE]"""

from dpcore.bench.kernels import main

if __name__ == "__main__":
    main()
