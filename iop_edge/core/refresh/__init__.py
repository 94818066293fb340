"""A config refresh, pure: what a candidate changes and how to apply it (design §5)."""
