"""ringtrain: distributed data-parallel training for PyTorch, and why it is fast or slow.

Train your own model and data with every ringtrain guarantee (exactly-once data, full-batch-exact
accumulation, verified checkpoints and resume, elastic restarts)::

    import ringtrain
    summary = ringtrain.fit(model=build_model, train_data=train_ds, eval_data=val_ds, loss="cross_entropy",
                            config={"train": {"epochs": 3, "global_batch_size": 64, "local_batch_size": 32}})

and launch the script with ``ringtrain run script.py --nproc 2``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["fit", "__version__"]

if TYPE_CHECKING:
    from ringtrain.api import fit


def __getattr__(name: str) -> Any:
    # Imported on first use, so `ringtrain --help` does not pay for importing torch.
    if name == "fit":
        from ringtrain.api import fit

        return fit
    raise AttributeError(f"module 'ringtrain' has no attribute {name!r}")
