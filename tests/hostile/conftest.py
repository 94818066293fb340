from tests.e2e.conftest import stack_one

__all__ = ["stack_one"]
