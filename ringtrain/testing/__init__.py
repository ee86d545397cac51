"""Test facilities that ship with ringtrain (armed only by a test harness)."""
