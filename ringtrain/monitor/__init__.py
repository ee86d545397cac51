"""Monitoring: step timing and the loggers that carry metrics to people and tools."""
