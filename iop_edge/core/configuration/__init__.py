"""The Edge config, pure: loading and checking it (design §2), the rules no type can
express, its reference, and what a refresh candidate re-checks (design §5)."""
