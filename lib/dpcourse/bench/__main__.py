"""``python -m dpcourse.bench allreduce|ddp|scaling|single ...`` (see :mod:`dpcourse.bench`)."""

import sys

from dpcourse.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
