"""The tests of course/."""
