"""Benchmark helpers: a user-space WAN emulator and related tools."""
