"""``python -m dpcourse.bench allreduce|ddp|scaling|single ...`` (see :mod:`dpcourse.bench`)."""

import sys

from dpcourse.bench.cli import main

sys.exit(main())
