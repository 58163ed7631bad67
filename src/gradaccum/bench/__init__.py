"""Measurement: timing, memory, communication counts, sweeps and the adoption verdict."""
