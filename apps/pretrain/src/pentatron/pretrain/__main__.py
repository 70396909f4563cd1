"""`torchrun --nproc-per-node N -m pentatron.pretrain [flags]`."""

import sys

from .pretrain_gpt import main

sys.exit(main())
