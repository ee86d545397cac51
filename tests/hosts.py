"""This path's test facility now lives in ``ringtrain.testing.hosts`` (issue 45: top-level bench/ runs it too, and
bench/ must not import tests/); ``import tests.hosts`` is that very module, so every name,
private ones and module state included, stays where the tests look for it."""

import sys

from ringtrain.testing import hosts as _module

if __name__ != "__main__":
    sys.modules[__name__] = _module

if __name__ == "__main__":  # `python -m tests.hosts up 2 ...`, as docs/many-hosts.md shows
    sys.exit(_module.main())
