import sys

from iop_edge.cli import main

sys.exit(main())
