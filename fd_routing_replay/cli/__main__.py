"""``python -m fd_routing_replay.cli``: the ``fd-rr`` command."""

import sys

from fd_routing_replay.cli.app import main

sys.exit(main())
