"""The tests of loadtest/."""
