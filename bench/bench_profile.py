"""The wrapper's own cost per step by stage; see dpcore/bench/profile.py. Usage:
python bench/bench_profile.py [--quick] [--repeats STEPS] [--json FILE]"""

from dpcore.bench.profile import main

if __name__ == "__main__":
    main()
