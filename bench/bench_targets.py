"""The targets of issue 34, each a ratio against its baseline in the same
run, alternating rounds; see dpcore/bench/targets.py. Usage:
python bench/bench_targets.py [--quick] [--repeats N] [--rounds R] [--json FILE] [--only ROW]"""

from dpcore.bench.targets import main

if __name__ == "__main__":
    main()
