"""The tests of the load generator, the step simulator and its cost models (loadtest/)."""
