"""Tests of the Node's provider adapters, against real sockets and real processes."""
