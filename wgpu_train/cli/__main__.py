"""`python -m wgpu_train.cli ...`: the wgpu-train command."""
import sys

from wgpu_train.cli.main import main

sys.exit(main())
