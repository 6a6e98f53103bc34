"""``python -m dpcore.info``: prints dpcore.info() one fact per line (see main)."""

from dpcore.info import main

if __name__ == "__main__":
    main()
