"""Entry script of the cloudtrain training application.

Runs as `python src/training_application.py ...`, under `accelerate launch` or `torchrun`, and as a
SageMaker entry script with `src/` as the source dir: in every case this file's folder is first on
sys.path, so the `cloudtrain` package beside it imports without installation.
"""

import sys

from cloudtrain.cli import main

if __name__ == "__main__":
    sys.exit(main())
