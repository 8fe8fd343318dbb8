"""The tests of the packages beside the chapter (serving/, checkpoints/, loadtest/, course/) and
the command line: one file per concept, beside the spec (test_lab.py), in a folder per package
(serving/, course/, loadtest/, checkpoints/); the engine's events, which the course's trace
listens to, here."""
