"""Public conformance suites run against IOP (`just test-suites`)."""
