"""The exact step: the window engine, the accumulator, its settings and result, the checks and
agreement points around it, gradient norms, and the out-of-memory retry."""
