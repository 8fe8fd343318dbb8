"""The tests of checkpoints/."""
