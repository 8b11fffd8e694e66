"""Pure-Python core (no torch): specs, planner, hashing, block pool, managers, coordinator."""
