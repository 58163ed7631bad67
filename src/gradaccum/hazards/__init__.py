"""What breaks equivalence: the static scan, and the guard for hand-written loops."""
