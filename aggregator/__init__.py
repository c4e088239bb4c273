"""Aggregator side of the THC toolkit: the switch's logic in Python, the userspace server, the control
plane."""
