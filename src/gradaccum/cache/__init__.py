"""Gradient caching: exact accumulation for losses over the whole window's representations."""
