"""Models on demand (design §18): the runtimes' loads and unloads, as the Edge asks them."""
