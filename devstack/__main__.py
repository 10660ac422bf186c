"""`python3 -m stoker.devstack up | down [--wipe] | status` (what `ops/stack` and `stoker stack` run)."""

import sys

from stoker.devstack.stack import main

sys.exit(main())
