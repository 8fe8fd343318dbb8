"""The tests of the packages beside the chapter (serving/, checkpoints/, loadtest/, course/) and
the command line: one file per concept, beside the spec (test_lab.py). The server's are here; the
course's, the load generator's and the checkpoints' in a folder each (course/, loadtest/,
checkpoints/)."""
