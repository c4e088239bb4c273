"""Simulations of THC training under packet loss, stragglers and scale."""
