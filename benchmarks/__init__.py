"""Benchmark runners for packed_encoders (not part of the installed package)."""
