"""`python3 -m devstack up | down [--wipe] | status` (what `ops/stack` and `stoker stack` run)."""

import sys

from devstack.stack import main

sys.exit(main())
