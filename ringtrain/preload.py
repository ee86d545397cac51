"""What the forkserver that ``ringtrain train``'s workers fork from imports once, before it forks any
(``launch.FORKSERVER_PRELOAD``): torch, torch._dynamo (DDP's constructor imports it: seconds), torch's
elastic error recording and ringtrain's trainer. Then ``gc.freeze()``: a full garbage collection in a forked
worker would otherwise walk every object imported here, writing to each page it touches (copy-on-write);
Python's gc documentation advises freezing for a server that forks (tests/rank_preload.py does the same for
the test harness's ranks). scikit-learn and torch.distributed.checkpoint are left to the workers that use
them (tests/launch/test_worker_imports.py).

No name here holds ``ringtrain.worker``: the forkserver's command line lists this module, and
``ringtrain.worker`` in a command line is how a worker is found."""

from __future__ import annotations

import gc

import torch._dynamo  # noqa: F401
import torch.distributed.elastic.multiprocessing.errors  # noqa: F401

import ringtrain.config  # noqa: F401
import ringtrain.group.init  # noqa: F401
import ringtrain.heal.membership  # noqa: F401
import ringtrain.train.run  # noqa: F401

gc.freeze()
