"""The lab generated from solution.py, the student's copy of it, its half-way states and its autograder."""
