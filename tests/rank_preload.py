"""What the harness's forkserver (tests/distributed.py) imports once, before it forks any rank: everything a rank
imports to build a trainer and to unpickle a test's function, so no rank imports it again.

Measured per rank, forked from a server that had imported torch, numpy, torch._dynamo, sklearn and ringtrain's
trainer: unpickling a test module's function imported pytest (0.42 s of CPU); a full garbage collection in the
rank walks every object the server imported (0.27 s), writing to each page it touches (copy-on-write).
``gc.freeze()`` moves them to a generation the collector never visits: Python's gc documentation advises it for
a server that forks.
"""

from __future__ import annotations

import gc

import numpy  # noqa: F401
import pytest  # noqa: F401 - every test module imports it, so unpickling a test's function does
import sklearn.datasets  # noqa: F401
import torch  # noqa: F401
import torch._dynamo  # noqa: F401 - DDP's constructor imports it: seconds
import torch.distributed  # noqa: F401

import ringtrain.train.build  # noqa: F401
import tests.faults  # noqa: F401
import tests.trainers  # noqa: F401

gc.freeze()
