"""``python -m pyro_subspace.cli``: the same as the ``pyro-subspace`` command."""

import sys

from .main import main

sys.exit(main())
