"""One intra-op thread in the test process: the worker ranks share the same few cores."""

import torch

torch.set_num_threads(1)
