"""The pages' own checks: every command README.md and docs/ show runs (check_docs), and their
words fit the checkout and the student's copy (check_words)."""
