"""Test facilities that ship with ringtrain because product code calls into them: ``faults`` (named fault points,
armed only by a test harness's plan)."""
