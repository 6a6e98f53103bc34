"""dp.generate against the bare model's generate; see dpcore/bench/generate.py. Usage:
python bench/bench_generate.py [--devices cpu:2|0,0] [--quick] [--repeats N] [--json FILE] [--new-tokens N]"""

from dpcore.bench.generate import main

if __name__ == "__main__":
    main()
