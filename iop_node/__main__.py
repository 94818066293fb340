"""`python -m iop_node`: the `iop-node` console script without installing the package."""

import sys

from iop_node.cli import main

sys.exit(main())
