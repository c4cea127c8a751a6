"""``python -m benchmarks.optim_oracle``."""

import sys

from benchmarks.optim_oracle.command import main

if __name__ == "__main__":
  sys.exit(main())
