"""The wrapper's own cost per step in instructions (callgrind), against DDP's;
see dpcore/bench/instructions.py. Usage:
python bench/bench_instructions.py [--quick] [--repeats STEPS] [--json FILE]"""

from dpcore.bench.instructions import main

if __name__ == "__main__":
    main()
