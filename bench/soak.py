"""Soak test of dpcore.DataParallel: threads and RSS must not grow; see
dpcore/bench/soak.py. Usage:
python bench/soak.py [--steps 10000] [--devices cpu:4|0,0,0,0] [--repeats STEPS_PER_SAMPLE] [--json FILE]"""

from dpcore.bench.soak import main

if __name__ == "__main__":
    main()
