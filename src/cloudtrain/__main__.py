"""`python -m cloudtrain ...`: the same command line as the `cloudtrain` script."""

import sys

from cloudtrain.cli import main

sys.exit(main())
