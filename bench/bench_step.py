"""Training-step benchmark; see dpcore/bench/step.py. Usage:
python bench/bench_step.py [--devices cpu:4|0,0,0,0] [--quick] [--json FILE]"""

from dpcore.bench.step import main

if __name__ == "__main__":
    main()
