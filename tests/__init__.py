"""The tests of serving/ and the command line: one file per concept, beside the spec (test_lab.py)."""
