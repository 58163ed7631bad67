"""User journeys: what a new user types or calls, with its output asserted line by line."""
